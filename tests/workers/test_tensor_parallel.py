"""Tensor parallelism without Ray: 2 and 4 processes (gloo) run `RankLoop` in lockstep and give
the same greedy tokens as one process, with and without speculative decoding (draft sharded or
replicated on every rank), on a hybrid SWA model (4 ranks replicate its 2 KV heads). A second
wave reuses the first's prefixes: every rank's prefix cache makes the same hits, and after a
flush broadcast in the plan every rank's pools end full. Gemma 4 (two attention geometries, KV
sharing, per-layer embeddings) on two ranks too, also drafted by its assistant (sharded, reading
each rank's shard of the target's KV), and the mixtures of experts of Gemma 4 and gpt-oss, split
by tensor and by expert. The
same runs on GPUs with NCCL are in test_gpu_tensor_parallel.py."""

import datetime
import os
import pickle
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.draft_models import make_eagle_head, make_gemma4_assistant, make_perturbed_copy
from tests.hf_models import make_tiny_model, random_prompts
from tests.workers.test_moe import quantize_checkpoint_mxfp4, record_routes
from workers.distributed import TPGroup
from workers.engine import Engine, SamplingParams
from workers.rank_loop import RankLoop

GREEDY = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
FIRST = random_prompts([29, 11, 17])
PROMPTS = FIRST + [FIRST[0][:21] + [7, 8, 9], FIRST[1]]  # the second wave hits the first's pages


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, runs: list[dict], sampling: SamplingParams, results) -> None:
    torch.set_num_threads(1)
    cuda = runs[0].get("device") == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    control = dist.new_group(backend="gloo") if cuda else dist.group.WORLD
    for engine_kwargs in runs:
        _serve(rank, world, control, engine_kwargs, sampling, results)
    dist.barrier(group=control)  # no rank closes its connections while another still reads from them
    dist.destroy_process_group()
    # Leave without running C++ static destructors: at interpreter exit gloo's threads were now
    # and then destroyed while joinable ("terminate called without an active exception").
    results.close()
    results.join_thread()
    os._exit(0)


def _serve(rank: int, world: int, control, engine_kwargs: dict, sampling: SamplingParams, results) -> None:
    """PROMPTS in two waves through one engine of the group, then a cache flush; rank 0 puts the
    outputs on `results`."""
    engine = Engine(**engine_kwargs, tp=TPGroup(rank, world, dist.group.WORLD))
    outputs = {}

    def on_updates(updates):
        for update in updates:
            if update.finished:
                outputs[update.rid] = update.output
                if len(outputs) == len(FIRST):
                    for i in range(len(FIRST), len(PROMPTS)):
                        loop.submit(f"r{i}", PROMPTS[i], sampling)
                if len(outputs) == len(PROMPTS):
                    loop.flush_cache()
                    loop.stop()

    loop = RankLoop(engine, rank, control, on_updates)
    if rank == 0:
        for i, prompt in enumerate(FIRST):
            loop.submit(f"r{i}", prompt, sampling)
    loop.run()
    engine.check_no_leak()
    engine.allocator.check_no_leak()  # the flush reached this rank: its pools are full
    if rank == 0:
        # Plain pickle: torch's queue would share tensors through this process, which is exiting.
        results.put(pickle.dumps([outputs[f"r{i}"] for i in range(len(PROMPTS))]))


def run_tp(world: int, engine_kwargs: dict, sampling: SamplingParams = GREEDY):
    """Outputs of PROMPTS from `world` ranks in lockstep (one process each)."""
    return run_tp_each(world, [engine_kwargs], sampling)[0]


def run_tp_each(world: int, runs: list[dict], sampling: SamplingParams = GREEDY) -> list:
    """`run_tp`'s outputs for each of `runs` (engine arguments), one after another in the same
    processes (started once)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, port, runs, sampling, results))
        for port in [_free_port()]
        for r in range(world)
    ]
    for p in procs:
        p.start()
    out = [pickle.loads(results.get(timeout=300)) for _ in runs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return out


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    target = str(root / "gemma3")
    make_tiny_model("gemma3", target)
    return {
        "target": target,
        "draft": make_perturbed_copy(target, str(root / "draft"), noise=0.1),
        "eagle": make_eagle_head(target, str(root / "eagle"), 1),
    }


@pytest.mark.parametrize(
    "world, speculative", [(2, None), (2, "standalone"), (2, "standalone-replicated"), (4, "eagle")]
)
def test_tensor_parallel_matches_one_rank(model_dirs, world, speculative):
    kwargs = dict(
        model=model_dirs["target"],
        page_size=4,
        chunked_prefill_size=8,
        max_total_tokens=2048,
        attention_backend="trtllm_mha",
    )
    if speculative in ("standalone", "standalone-replicated"):
        kwargs["speculative"] = {
            "algorithm": "standalone",
            "draft_model": model_dirs["draft"],
            "num_steps": 3,
            "draft_tp": "replicate" if speculative.endswith("replicated") else "shard",
            "adaptive": False,  # fixed rounds: one rank's accept lengths are the group's
        }
    elif speculative == "eagle":
        kwargs["speculative"] = {"algorithm": "eagle", "draft_model": model_dirs["eagle"], "num_steps": 3}
        kwargs["speculative"]["adaptive"] = False
    single = Engine(**kwargs)
    ref = single.generate(prompt_token_ids=FIRST, sampling=GREEDY)
    ref += single.generate(prompt_token_ids=PROMPTS[len(FIRST) :], sampling=GREEDY)
    got = run_tp(world, kwargs)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert [o.cached_tokens for o in got] == [o.cached_tokens for o in ref]
    assert min(o.cached_tokens for o in got[len(FIRST) :]) >= 8
    if speculative:
        assert [o.spec.accept_lengths for o in got] == [o.spec.accept_lengths for o in ref]


def test_a_group_runs_the_draft_lengths_rank_0_chose(model_dirs):
    """Adaptive draft lengths on two ranks: each rank times its own steps, and every decode step
    runs what rank 0's controller chose (the step plan carries it), so the ranks stay in lockstep
    through rounds and plain steps; greedy tokens equal one rank's without speculation."""
    kwargs = dict(
        model=model_dirs["target"],
        page_size=4,
        chunked_prefill_size=8,
        max_total_tokens=2048,
        attention_backend="trtllm_mha",
    )
    single = Engine(**kwargs)
    ref = single.generate(prompt_token_ids=FIRST, sampling=GREEDY)
    ref += single.generate(prompt_token_ids=PROMPTS[len(FIRST) :], sampling=GREEDY)
    spec = {"algorithm": "eagle", "draft_model": model_dirs["eagle"], "num_steps": 3}  # adaptive by default
    got = run_tp(2, {**kwargs, "speculative": spec})
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert all(o.spec.verify_steps for o in got) and any(o.spec.plain_steps for o in got)


@pytest.mark.parametrize("draft", [None, "assistant"])
def test_gemma4_tensor_parallel_matches_one_rank(tmp_path, draft):
    """Gemma 4's two geometries on two ranks: the sliding layers' 2 KV heads split, the full
    layers' one KV head replicated, the per-layer embedding table split by vocabulary, and the
    KV-sharing layers reading their rank's shard of the layers they share; its assistant (with
    its centroid head) drafting from those shards gives the same accept lengths."""
    path = str(tmp_path / "gemma4")
    make_tiny_model("gemma4", path)
    kwargs = dict(
        model=path, page_size=16, chunked_prefill_size=8, max_total_tokens=2048, attention_backend="trtllm_mha"
    )
    if draft == "assistant":
        assistant = make_gemma4_assistant(path, str(tmp_path / "assistant"), copies=10.0)
        kwargs["speculative"] = {"algorithm": "mtp", "draft_model": assistant, "num_steps": 3, "adaptive": False}
    single = Engine(**kwargs)
    ref = single.generate(prompt_token_ids=FIRST, sampling=GREEDY)
    ref += single.generate(prompt_token_ids=PROMPTS[len(FIRST) :], sampling=GREEDY)
    got = run_tp(2, kwargs)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert [o.cached_tokens for o in got] == [o.cached_tokens for o in ref]
    if draft:
        assert [o.spec.accept_lengths for o in got] == [o.spec.accept_lengths for o in ref]
        assert any(n > 1 for o in ref for n in o.spec.accept_lengths)


@pytest.mark.parametrize("name", ["gemma4_moe", "gpt_oss"])
def test_mixture_of_experts_tensor_parallel_matches_one_rank(tmp_path, name):
    """The experts shared by two ranks both ways, the router on every rank: split by their
    intermediate dimension (gpt-oss's down-projection bias added by one rank), and by expert
    (`moe_parallel: expert`, four whole experts a rank, each adding its experts' biases), gpt-oss's
    sinks split with the heads and its experts loaded from MXFP4 (one rank and whole experts in 4
    bits, 16-column shares dequantised as they load): the same tokens as one rank.
    Every expert of every layer is chosen by some token, so every rank's experts take part."""
    path = str(tmp_path / name)
    make_tiny_model(name, path)
    if name == "gpt_oss":
        quantize_checkpoint_mxfp4(path)
    kwargs = dict(
        model=path, page_size=16, chunked_prefill_size=8, max_total_tokens=2048, attention_backend="trtllm_mha"
    )
    single = Engine(**kwargs)
    chosen = record_routes(single.runner.model)
    ref = single.generate(prompt_token_ids=FIRST, sampling=GREEDY)
    ref += single.generate(prompt_token_ids=PROMPTS[len(FIRST) :], sampling=GREEDY)
    assert all(seen == set(range(single.cfg.moe.num_experts)) for seen in chosen.values())
    modes = ("tensor", "expert")
    for moe_parallel, got in zip(modes, run_tp_each(2, [{**kwargs, "moe_parallel": m} for m in modes])):
        assert [o.token_ids for o in got] == [o.token_ids for o in ref], moe_parallel
        assert [o.cached_tokens for o in got] == [o.cached_tokens for o in ref], moe_parallel


def test_tp_all_reduce_setting_is_checked(model_dirs):
    with pytest.raises(ValueError, match="tp_all_reduce"):
        Engine(model=model_dirs["target"], max_total_tokens=256, tp_all_reduce="ring")
