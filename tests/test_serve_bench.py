"""The serving benchmark on the in-process engine: every request completes with the lengths the
workload asked for, multi-turn prompts grow by the previous answer, and the report carries
bench_serving's metric names with consistent values. The in-process engine at TP 2 (a rank in a
process of its own, gloo on CPU) gives one rank's greedy tokens; a launched application's router
policy reaches its settings and the run's case name."""

import asyncio
import json
import logging
import time

import pytest
import torch.distributed as dist

from cluster.config import AppArgs, RouterArgs
from ops.bench import serve_bench
from workers.engine import Engine
from workers.sampling_params import SamplingParams

COMMON = ["--backend", "engine", "--model", "tiny-gemma3", "--device", "cpu", "--disable-tqdm"]


def test_random_dataset_on_the_engine(tmp_path):
    out = tmp_path / "r.json"
    args = ["--num-prompts", "6", "--random-input-len", "40", "--random-output-len", "9", "--max-concurrency", "3"]
    result = serve_bench.main(COMMON + args + ["--output-file", str(out)])
    assert json.loads(out.read_text())["completed"] == result["completed"] == 6 and result["failed"] == 0
    assert result["total_input_tokens"] == 6 * 40 and result["total_output_tokens"] == 6 * 9
    for name in ("ttft", "tpot", "itl", "e2e_latency"):
        assert 0 < result[f"median_{name}_ms"] <= result[f"p99_{name}_ms"]
    assert result["mean_ttft_ms"] < result["mean_e2e_latency_ms"]
    assert result["output_throughput"] == result["total_output_tokens"] / result["duration"]
    assert result["concurrency"] <= 3 + 1e-6 and result["mean_accept_length"] is None
    # the engine's view of where each first token's time went
    assert result["server_mean_queue_ms"] >= 0 and result["server_mean_prefill_ms"] > 0


def test_multi_turn_dataset_with_speculation(tmp_path):
    args = ["--dataset-name", "multi-turn", "--num-prompts", "2", "--num-turns", "3", "--random-input-len", "20"]
    args += ["--multi-turn-new-len", "5", "--random-output-len", "6", "--speculative-algorithm", "eagle"]
    result = serve_bench.main(COMMON + args)
    assert result["completed"] == 6 and result["total_output_tokens"] == 6 * 6
    # turn k's prompt: the first prompt, then per earlier turn its answer and the new tokens
    assert result["total_input_tokens"] == 2 * (20 + (20 + 6 + 5) + (20 + 2 * (6 + 5)))
    assert result["mean_accept_length"] >= 1


def test_warm_up_matches_the_workloads_concurrency():
    """A concurrent workload warms up with as many requests as it runs at once (two requests
    left the stack's batch paths cold: its first c64 round ran 28% below the later ones)."""
    assert serve_bench.parse_args(["--max-concurrency", "64"]).warmup_requests == 64
    assert serve_bench.parse_args([]).warmup_requests == 2
    assert serve_bench.parse_args(["--max-concurrency", "64", "--warmup-requests", "1"]).warmup_requests == 1


def test_compare_rounds_draw_new_prompts_each_round(monkeypatch):
    """Both sides of a round run the same prompts; no round repeats an earlier one's (they would
    be prefix-cache hits in both engines)."""
    prompts: list[tuple[str, list[int]]] = []
    sizes: list[int] = []

    def fake_measure(backend, args, vocab, metrics_url=None):
        prompts.append((backend, serve_bench.conversations(args, vocab)[0][0][0]))
        return {"median_ttft_ms": 1.0, "median_tpot_ms": 1.0, "median_itl_ms": 1.0, "output_throughput": 1.0}

    class FakeEngineBackend:
        def __init__(self, settings, tp_size=1):
            sizes.append(tp_size)

        def __str__(self):
            return "engine"

        def close(self):
            pass

    monkeypatch.setattr(serve_bench, "measure", fake_measure)
    monkeypatch.setattr(serve_bench, "EngineBackend", FakeEngineBackend)
    monkeypatch.setattr(serve_bench, "make_backend", lambda args, settings: ("stack", None))
    args = serve_bench.parse_args(
        ["--backend", "grpc", "--compare-rounds", "3", "--num-prompts", "4", "--tp-size", "2"]
    )
    result = serve_bench.compare(args, {}, 1000)
    assert len(result["rounds"]) == 3 and len(prompts) == 6
    assert sizes == [2]  # the in-process side runs at the stack's TP size
    by_round = [prompts[i : i + 2] for i in range(0, 6, 2)]
    assert all(str(a) != str(b) and pa == pb for (a, pa), (b, pb) in by_round)  # both sides, one set
    firsts = [pa for (_, pa), _ in by_round]
    assert len({tuple(p) for p in firsts}) == 3


def test_an_abandoned_engine_stream_frees_its_request(caplog):
    """A run interrupted mid-stream (a timeout, Ctrl-C) aborts the engine's request instead of
    leaving it decoding for a reader that is gone; later runs on the same engine are unaffected."""
    args = serve_bench.parse_args(["--device", "cpu", "--page-size", "4", "--max-total-tokens", "2048"])
    backend = serve_bench.EngineBackend(serve_bench.engine_settings(args))
    try:

        async def read(n: int, output_len: int) -> int:
            stream, tokens = backend.stream(list(range(3, 40)), output_len), 0
            async for chunk in stream:
                tokens += len(chunk.tokens)
                if tokens >= n:
                    break
            await stream.aclose()
            return tokens

        assert asyncio.run(read(3, 1000)) >= 3
        deadline = time.monotonic() + 10
        while (backend.loop.in_flight or backend.engine.has_unfinished()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not backend.engine.has_unfinished() and not backend.queues
        assert backend.loop.steps < 200  # aborted, not run to its 1,000 tokens
        assert asyncio.run(read(10**6, 5)) == 5  # a new event loop, a whole request
        backend.engine.check_no_leak()
        assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    finally:
        backend.close()


def test_in_process_engine_at_tp2_gives_one_ranks_tokens():
    """`--backend engine --tp-size 2`: rank 0 here, rank 1 in a process of its own; concurrent
    greedy requests get the tokens one rank's engine generates, and closing ends the other rank
    and leaves the process group."""
    args = ["--device", "cpu", "--page-size", "4", "--max-total-tokens", "2048", "--num-prompts", "3"]
    args = serve_bench.parse_args(args + ["--random-input-len", "24", "--random-output-len", "8", "--tp-size", "2"])
    settings = serve_bench.engine_settings(args)
    requests = [turns[0] for turns in serve_bench.conversations(args, 1000)]
    backend, metrics_url = serve_bench.make_backend(args, settings)
    try:
        assert metrics_url is None and backend.engine.tp.size == 2

        async def run_all() -> list[serve_bench.Result]:
            return await asyncio.gather(*(serve_bench._one(backend.stream, p, n) for p, n in requests))

        results = asyncio.run(run_all())
        backend.engine.check_no_leak()
    finally:
        backend.close()
    assert [p.exitcode for p in backend.ranks] == [0] and not dist.is_initialized()
    sampling = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for _, n in requests]
    expected = Engine(**settings).generate([p for p, _ in requests], sampling)
    assert [r.error for r in results] == [None] * len(requests)
    assert [r.output_ids for r in results] == [o.token_ids for o in expected]


def test_router_policy_reaches_the_launched_application_and_the_case_name():
    args = ["--backend", "grpc", "--num-replicas", "2", "--max-concurrency", "64", "--router-policy", "cache_aware"]
    args = serve_bench.parse_args(args)
    assert AppArgs.from_flat(serve_bench.app_settings(args)).router.policy == "cache_aware"
    assert serve_bench.workload(args) == "tiny-gemma3/grpc/r2/router-cache_aware/c64/in256-out64"
    default = serve_bench.parse_args(["--backend", "grpc"])
    assert AppArgs.from_flat(serve_bench.app_settings(default)).router.policy == RouterArgs().policy
    explicit_default = serve_bench.parse_args(["--backend", "grpc", "--router-policy", RouterArgs().policy])
    names = {serve_bench.workload(default), serve_bench.workload(explicit_default)}
    assert names == {"tiny-gemma3/grpc/rateinf/in256-out64"}  # the default policy goes unnamed


@pytest.mark.parametrize(
    "argv",
    [
        ["--backend", "engine", "--router-policy", "round_robin"],
        ["--backend", "grpc", "--host", "127.0.0.1", "--router-policy", "round_robin"],
        ["--backend", "http", "--base-url", "http://127.0.0.1:8000/generate", "--router-policy", "round_robin"],
    ],
)
def test_router_policy_is_refused_without_a_launched_application(argv):
    with pytest.raises(SystemExit, match="--router-policy"):
        serve_bench.parse_args(argv)
