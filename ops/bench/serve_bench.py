"""Serving benchmark in the manner of `python -m sglang.bench_serving` and `vllm bench serve`.

    python -m ops.bench.serve_bench --backend engine --model tiny-gemma3 --num-prompts 8 --output-file r.json
    python -m ops.bench.serve_bench --backend grpc --model tiny-gemma3 --num-prompts 64 --max-concurrency 8
    python -m ops.bench.serve_bench --backend grpc --host 127.0.0.1 --port 50051 ...   # a running server
    python -m ops.bench.serve_bench --backend grpc --compare-rounds 3 --tp-size 2 ...  # both sides at TP 2

Backends: `engine` (the in-process engine, driven through the rank loop a rank actor runs; with
--tp-size N, rank 0 of N ranks whose others run in processes of their own, one GPU each, as a
replica's rank actors do), `grpc` and `http` (the whole serving stack: a local Ray Serve
application started with the same engine settings, --tp-size, --num-replicas and --router-policy
unless --host/--port (--base-url for http) name a running one). The same workload on `engine` and
on `grpc` makes the stack's overhead one subtraction.

Datasets: `random` (input/output lengths drawn uniformly from [len x (1 - range ratio), len]),
`multi-turn` (locally generated conversations: each turn's prompt is the last prompt, its
answer and new user tokens; turns of a conversation run one after another). Requests arrive as
a Poisson process (`--request-rate`, inf: all at once) under `--max-concurrency`.

Reports (names as in bench_serving): completed, total_input_tokens, total_output_tokens,
request_throughput, output_throughput, total_token_throughput, {mean,median,std,p90,p99}_{ttft,
tpot,itl,e2e_latency}_ms, concurrency, mean_accept_length; written as JSON to --output-file.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import logging
import os
import platform
import random
import statistics
import threading
import time
import typing
from collections.abc import AsyncIterator, Callable
from typing import Any

import torch
from tqdm import tqdm

from cluster.config import RouterArgs
from ops import MODELS_DIR
from ops.bench import emit, free_port
from ops.bench.record import add_record_args, record_run

logger = logging.getLogger(__name__)
ROUTER_POLICIES = typing.get_args(RouterArgs.model_fields["policy"].annotation)
DEFAULT_ROUTER = RouterArgs().policy


@dataclasses.dataclass
class Chunk:
    """What one streamed response brought."""

    tokens: list[int]
    accept_lengths: list[int] | None = None  # on the last one, when speculation ran
    error: str | None = None


@dataclasses.dataclass
class Result:
    input_len: int
    output_ids: list[int]
    ttft: float
    itl: list[float]
    e2e: float
    accept_lengths: list[int]
    error: str | None = None


# -- workloads -------------------------------------------------------------------------------------
def _lengths(rng: random.Random, n: int, length: int, ratio: float) -> list[int]:
    return [rng.randint(max(1, int(length * (1 - ratio))), length) for _ in range(n)]


def _tokens(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def conversations(args: argparse.Namespace, vocab: int) -> list[list[tuple[list[int], int]]]:
    """Per conversation, per turn: (new prompt tokens, output length). A `random` request is a
    conversation of one turn."""
    rng = random.Random(args.seed)
    if args.dataset_name == "random":
        ins = _lengths(rng, args.num_prompts, args.random_input_len, args.random_range_ratio)
        outs = _lengths(rng, args.num_prompts, args.random_output_len, args.random_range_ratio)
        return [[(_tokens(rng, vocab, i), o)] for i, o in zip(ins, outs)]
    convs = []
    for _ in range(args.num_prompts):
        turns = [(_tokens(rng, vocab, args.random_input_len), args.random_output_len)]
        turns += [
            (_tokens(rng, vocab, args.multi_turn_new_len), args.random_output_len) for _ in range(args.num_turns - 1)
        ]
        convs.append(turns)
    return convs


# -- backends: each streams one request's chunks -----------------------------------------------------
Stream = Callable[[list[int], int], AsyncIterator[Chunk]]
PHASES = ("queue", "prefill")  # a request's time waiting for admission, and from there to its first token


def scrape_phase_totals(metrics_url: str) -> dict[str, list[float]]:
    """Seconds summed and requests counted, per phase, from a running stack's Prometheus
    histograms (`slidespec_request_{queue,prefill}_time_seconds`, every replica)."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    totals = {phase: [0.0, 0] for phase in PHASES}
    text = requests.get(metrics_url, timeout=30).text
    for family in text_string_to_metric_families(text):
        for phase in PHASES:
            if family.name == f"slidespec_request_{phase}_time_seconds":
                for sample in family.samples:
                    if sample.name.endswith("_sum"):
                        totals[phase][0] += sample.value
                    elif sample.name.endswith("_count"):
                        totals[phase][1] += sample.value
    return totals


TP_TIMEOUT = datetime.timedelta(seconds=300)  # joining the group, and each collective after


def _tp_init(port: int) -> str:
    return f"tcp://127.0.0.1:{port}"


def _serve_rank(rank: int, size: int, port: int, engine_kwargs: dict[str, Any]) -> None:
    """Rank `rank` (> 0) of the in-process engine's group, in its own process (one GPU each on
    CUDA): rank 0's plans until it stops the loop."""
    from workers.distributed import join_tp_group, leave_tp_group
    from workers.engine import Engine
    from workers.rank_loop import RankLoop

    device = engine_kwargs.get("device", "cpu")
    if device == "cuda":
        torch.cuda.set_device(rank)
    tp, control = join_tp_group(rank, size, _tp_init(port), device, TP_TIMEOUT)
    loop = RankLoop(Engine(**engine_kwargs, tp=tp), rank, control)
    loop.run()
    if loop.error is not None:  # logged by the loop; rank 0's loop fails on its next collective
        os._exit(1)
    leave_tp_group(control, device)
    # Without C++ static destructors: at interpreter exit gloo's threads were now and then
    # destroyed while joinable; NCCL's communicators stay up (`leave_tp_group`).
    os._exit(0)


class EngineBackend:
    """The in-process engine behind a `RankLoop` in a thread, as a rank actor runs it. With
    `tp_size` > 1 it is rank 0 of a tensor-parallel group whose other ranks run in processes of
    their own on this host, as one replica's rank actors do (one GPU each on CUDA)."""

    def __init__(self, engine_kwargs: dict[str, Any], tp_size: int = 1) -> None:
        import torch.multiprocessing as mp

        from workers.distributed import SINGLE_RANK, join_tp_group
        from workers.engine import Engine
        from workers.rank_loop import RankLoop

        self.device = engine_kwargs.get("device", "cpu")
        self.ranks: list[mp.Process] = []
        tp, self.control = SINGLE_RANK, None
        if tp_size > 1:
            port, ctx = free_port(), mp.get_context("spawn")
            self.ranks = [
                ctx.Process(target=_serve_rank, args=(r, tp_size, port, engine_kwargs), daemon=True)
                for r in range(1, tp_size)
            ]
            for p in self.ranks:
                p.start()
            if self.device == "cuda":
                torch.cuda.set_device(0)
            tp, self.control = join_tp_group(0, tp_size, _tp_init(port), self.device, TP_TIMEOUT)
        self.engine = Engine(**engine_kwargs, tp=tp)
        self.loop = RankLoop(self.engine, 0, self.control, self._on_updates)
        self.queues: dict[str, asyncio.Queue] = {}
        self.aio: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=self.loop.run, daemon=True)
        self.thread.start()
        self.count = 0
        self.phases = {phase: [0.0, 0] for phase in PHASES}  # seconds summed, requests

    def phase_totals(self) -> dict[str, list[float]]:
        return {phase: list(total) for phase, total in self.phases.items()}

    def _on_updates(self, updates) -> None:
        """One hand-over to the event loop per step, as the rank actor does; none once the
        workload's event loop has ended (an interrupted run's requests are being aborted)."""
        if not self.aio.is_closed():
            self.aio.call_soon_threadsafe(self._deliver, updates)

    def _deliver(self, updates) -> None:
        for update in updates:
            if update.output is not None:
                for phase, total in self.phases.items():
                    seconds = getattr(update.output, f"{phase}_s")
                    if seconds is not None:
                        total[0] += seconds
                        total[1] += 1
            queue = self.queues.get(update.rid)
            if queue is not None:  # else: its reader left and the request was aborted
                queue.put_nowait(update)

    async def stream(self, prompt: list[int], output_len: int) -> AsyncIterator[Chunk]:
        from workers.sampling_params import SamplingParams

        self.count += 1
        rid, queue = f"bench-{self.count}", asyncio.Queue()
        self.aio = asyncio.get_running_loop()
        self.queues[rid] = queue
        self.loop.submit(rid, prompt, SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True))
        finished = False
        try:
            while not finished:
                update = await queue.get()
                finished = update.finished
                spec = update.output.spec if update.output is not None else None
                yield Chunk(update.token_ids, spec.accept_lengths if spec else None, update.error)
        finally:
            del self.queues[rid]
            if not finished:  # the reader left (an interrupted or timed-out run): free the request
                self.loop.abort(rid)

    def close(self) -> None:
        """Stop the loop; with other ranks, they stop with it, exit, and the group is left."""
        from workers.distributed import leave_tp_group

        self.loop.stop()
        self.thread.join(timeout=30)
        if not self.ranks:
            return
        if self.loop.error is None and not self.thread.is_alive():
            leave_tp_group(self.control, self.device)
        for p in self.ranks:
            p.join(timeout=30)
            if p.exitcode is None:
                p.kill()
                p.join()
        failed = [f"rank {r} ({p.exitcode})" for r, p in enumerate(self.ranks, 1) if p.exitcode]
        if failed:
            logger.warning("in-process engine: %s exited with an error", ", ".join(failed))


class GrpcBackend:
    def __init__(self, target: str) -> None:
        from cluster.client import AsyncGenerationClient

        self.target, self.client_cls, self.client = target, AsyncGenerationClient, None

    async def stream(self, prompt: list[int], output_len: int) -> AsyncIterator[Chunk]:
        if self.client is None:  # channels belong to the event loop that made them
            self.client = self.client_cls(self.target)
        try:
            async for r in self.client.generate(prompt, max_new_tokens=output_len, temperature=0.0, ignore_eos=True):
                yield Chunk(list(r.token_ids), list(r.spec.accept_lengths) if r.finished else None)
        except Exception as exc:  # noqa: BLE001 - grpc.aio.AioRpcError: counted as a failed request
            yield Chunk([], None, f"{type(exc).__name__}: {exc}")

    async def aclose(self) -> None:
        if self.client is not None:
            await self.client.close()
            self.client = None


class HttpBackend:
    def __init__(self, url: str) -> None:
        self.url, self.session = url, None

    async def stream(self, prompt: list[int], output_len: int) -> AsyncIterator[Chunk]:
        import aiohttp

        if self.session is None:
            self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        body = {
            "prompt_token_ids": prompt,
            "sampling": {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True},
        }
        async with self.session.post(self.url, json=body) as r:
            if r.status != 200:
                yield Chunk([], None, f"HTTP {r.status}: {await r.text()}")
                return
            async for line in r.content:
                if line.strip():
                    d = json.loads(line)
                    accept = d.get("spec", {}).get("accept_lengths") if d.get("finished") else None
                    yield Chunk(d.get("token_ids", []), accept, d.get("error"))

    async def aclose(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None


class OpenAIBackend(HttpBackend):
    """The OpenAI-compatible completions route, streamed (token ids through vLLM's
    `return_token_ids` extension, so tokens are counted as on the other backends)."""

    def __init__(self, base_url: str, model: str) -> None:
        super().__init__(base_url.rstrip("/") + "/completions")
        self.model = model

    async def stream(self, prompt: list[int], output_len: int) -> AsyncIterator[Chunk]:
        import aiohttp

        if self.session is None:
            self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": output_len,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }
        async with self.session.post(self.url, json=body) as r:
            if r.status != 200:
                yield Chunk([], None, f"HTTP {r.status}: {await r.text()}")
                return
            async for line in r.content:
                data = line.strip().removeprefix(b"data: ")
                if not data or data == b"[DONE]":
                    continue
                d = json.loads(data)
                if "error" in d:
                    yield Chunk([], None, d["error"]["message"])
                    continue
                choice = d["choices"][0] if d.get("choices") else {}
                accept = [n for s in d.get("speculative", []) for n in s["accept_lengths"]] or None
                yield Chunk(choice.get("token_ids", []), accept if choice.get("finish_reason") else None)


# -- the driver ----------------------------------------------------------------------------------------
async def _one(stream: Stream, prompt: list[int], output_len: int) -> Result:
    start = last = time.perf_counter()
    ttft, itl, out, accept, error = 0.0, [], [], [], None
    async for chunk in stream(prompt, output_len):
        now = time.perf_counter()
        if chunk.error:
            error = chunk.error
        if chunk.tokens:
            if not out:
                ttft = now - start
            else:
                itl.append(now - last)
            last = now
            out += chunk.tokens
        accept = chunk.accept_lengths or accept
    return Result(len(prompt), out, ttft, itl, time.perf_counter() - start, accept, error)


async def run_workload(stream: Stream, convs: list, rate: float, concurrency: int | None, seed: int, bar: bool):
    gate = asyncio.Semaphore(concurrency or 1 << 30)
    rng = random.Random(seed)
    progress = tqdm(total=sum(map(len, convs)), disable=not bar)
    results: list[Result] = []

    async def conversation(turns: list[tuple[list[int], int]]) -> None:
        prompt: list[int] = []
        for new, output_len in turns:
            prompt = prompt + new
            async with gate:
                result = await _one(stream, prompt, output_len)
            results.append(result)
            progress.update(1)
            prompt = prompt + result.output_ids

    tasks = []
    start = time.perf_counter()
    for turns in convs:
        tasks.append(asyncio.create_task(conversation(turns)))
        if rate != float("inf"):
            await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)
    progress.close()
    return results, time.perf_counter() - start


def _stats(name: str, values: list[float]) -> dict[str, float]:
    ms = [v * 1e3 for v in values] or [0.0]
    q = statistics.quantiles(ms, n=100, method="inclusive") if len(ms) > 1 else ms * 99
    return {
        f"mean_{name}_ms": statistics.fmean(ms),
        f"median_{name}_ms": statistics.median(ms),
        f"std_{name}_ms": statistics.pstdev(ms),
        f"p90_{name}_ms": q[89],
        f"p99_{name}_ms": q[98],
    }


def metrics(results: list[Result], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.error is None]
    inputs, outputs = sum(r.input_len for r in ok), sum(len(r.output_ids) for r in ok)
    accept = [n for r in ok for n in r.accept_lengths]
    out = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration": duration,
        "total_input_tokens": inputs,
        "total_output_tokens": outputs,
        "request_throughput": len(ok) / duration,
        "input_throughput": inputs / duration,
        "output_throughput": outputs / duration,
        "total_token_throughput": (inputs + outputs) / duration,
        "concurrency": sum(r.e2e for r in ok) / duration,
        "mean_accept_length": statistics.fmean(accept) if accept else None,
    }
    tpot = [(r.e2e - r.ttft) / (len(r.output_ids) - 1) for r in ok if len(r.output_ids) > 1]
    for name, values in (
        ("ttft", [r.ttft for r in ok]),
        ("tpot", tpot),
        ("itl", [x for r in ok for x in r.itl]),
        ("e2e_latency", [r.e2e for r in ok]),
    ):
        out.update(_stats(name, values))
    return out


# -- set-up --------------------------------------------------------------------------------------------
def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Engine arguments both the in-process engine and a launched application use."""
    model = args.model if os.path.isdir(args.model) else os.path.join(MODELS_DIR, args.model)
    settings: dict[str, Any] = {
        "model": model,
        "device": args.device,
        "page_size": args.page_size,
        "max_total_tokens": args.max_total_tokens,
        "max_running_requests": args.max_running_requests,
        "load_format": args.load_format,
    }
    if args.speculative_algorithm:
        draft = args.speculative_draft_model
        settings["speculative"] = {
            "algorithm": args.speculative_algorithm,
            "draft_model": draft if os.path.isdir(draft) else os.path.join(MODELS_DIR, draft),
            "num_steps": args.speculative_num_steps,
            **({"token_map": args.speculative_token_map} if args.speculative_token_map else {}),
        }
    return settings


def app_settings(args: argparse.Namespace) -> dict[str, Any]:
    """A launched application's settings: the engine's, and how the stack around it runs."""
    app = {
        **engine_settings(args),
        "num_replicas": args.num_replicas,
        "tp_size": args.tp_size,
        "cpus_per_rank": 0.5,
        "grpc": {"port": 0},
        "stream_interval": args.stream_interval,
        "rank0_transport": args.rank0_transport,
    }
    if args.router_policy is not None:
        app["router"] = {"policy": args.router_policy}
    return app


def launch(args: argparse.Namespace) -> dict[str, str]:
    """A local Ray Serve application with the benchmark's engine settings: its gRPC target and
    HTTP route."""
    import ray
    from ray import serve

    from cluster.app import build_app

    http_port = free_port()
    ray.init(
        address="local",
        num_cpus=max(8, os.cpu_count() or 1),
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
    )
    serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    handle = serve.run(build_app(app_settings(args)), name="bench", route_prefix="/")
    grpc_port = handle.ports.remote().result()["grpc"]
    return {"grpc": f"127.0.0.1:{grpc_port}", "http": f"http://127.0.0.1:{http_port}"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=["engine", "grpc", "http", "openai"], default="engine")
    p.add_argument("--host", help="a running gRPC server (grpc backend); default: launch one")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument(
        "--base-url", help="a running JSON-lines route (http://127.0.0.1:8000/generate) or OpenAI base (.../v1)"
    )
    p.add_argument(
        "--metrics-url",
        help="a running stack's Prometheus route (http://127.0.0.1:8000/metrics), for the server's "
        "queue and prefill times; a launched application's is known",
    )
    p.add_argument("--model", default="tiny-gemma3", help="a shipped model name or a model directory")
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-total-tokens", type=int, default=65536)
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--num-replicas", type=int, default=1)
    p.add_argument(
        "--tp-size",
        type=int,
        default=1,
        help="tensor-parallel ranks of a launched application's replicas, and of the in-process engine (its other "
        "ranks in processes of their own, one GPU each on CUDA)",
    )
    p.add_argument(
        "--router-policy",
        choices=ROUTER_POLICIES,
        help=f"launched application: how requests are spread over replicas (default: the config's, {DEFAULT_ROUTER})",
    )
    p.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="launched application: tokens per streamed update after the first",
    )
    p.add_argument(
        "--rank0-transport",
        choices=["socket", "ray"],
        default="socket",
        help="launched application: how the ingress reaches rank 0 (its Unix socket, or Ray calls and a stream)",
    )
    p.add_argument("--speculative-algorithm", choices=["standalone", "eagle", "frozen_kv_mtp"])
    p.add_argument("--speculative-draft-model", default="tiny-gemma3-eagle")
    p.add_argument("--speculative-num-steps", type=int, default=4)
    p.add_argument("--speculative-token-map", help="a file of target token ids the draft proposes from")
    p.add_argument("--dataset-name", choices=["random", "multi-turn"], default="random")
    p.add_argument("--num-prompts", type=int, default=64, help="requests (random) or conversations (multi-turn)")
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--num-turns", type=int, default=4)
    p.add_argument("--multi-turn-new-len", type=int, default=64, help="user tokens each later turn adds")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests per second (Poisson)")
    p.add_argument("--max-concurrency", type=int)
    p.add_argument(
        "--warmup-requests",
        type=int,
        help="requests run before the measured ones (default: the workload's concurrency, at least 2, so that a "
        "concurrent workload finds every path of the stack warm)",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument(
        "--compare-rounds",
        type=int,
        default=0,
        help="alternate the in-process engine and the stack (--backend) this many rounds; report the stack's cost",
    )
    p.add_argument("--output-file")
    add_record_args(p)
    p.add_argument(
        "--log-level",
        default="warning",
        choices=["debug", "info", "warning", "error"],
        help="of this process (info: the in-process engine's start-up, graph capture times)",
    )
    args = p.parse_args(argv)
    if args.router_policy is not None and (args.backend == "engine" or args.host or args.base_url):
        raise SystemExit(
            "--router-policy: sets the router of an application this benchmark launches (--backend "
            "grpc, http or openai, without --host or --base-url)"
        )
    if args.warmup_requests is None:
        args.warmup_requests = max(2, args.max_concurrency or 0)
    return args


def make_backend(args: argparse.Namespace, settings: dict[str, Any]):
    """The backend `--backend` names, launching an application when no running one is given,
    and where its metrics are (`--metrics-url`, or the launched application's)."""
    if args.backend == "engine":
        return EngineBackend(settings, args.tp_size), None
    target = f"{args.host}:{args.port}" if args.host else None
    url, metrics_url = args.base_url, args.metrics_url
    if (args.backend == "grpc" and target is None) or (args.backend != "grpc" and url is None):
        where = launch(args)
        route = "/v1" if args.backend == "openai" else "/generate"
        target, url = target or where["grpc"], url or where["http"] + route
        metrics_url = metrics_url or where["http"] + "/metrics"
    if args.backend == "openai":
        backend = OpenAIBackend(url, os.path.basename(settings["model"]))
    else:
        backend = GrpcBackend(target) if args.backend == "grpc" else HttpBackend(url)
    return backend, metrics_url


def measure(backend, args: argparse.Namespace, vocab: int, metrics_url: str | None = None) -> dict[str, Any]:
    """Warm-up requests, then the workload; its metrics, and the engine's mean time per phase
    (`server_mean_queue_ms`, `server_mean_prefill_ms`) where it can be read: the in-process
    engine's outputs, or a stack's metrics at `metrics_url`."""

    async def bench():
        warm = conversations(
            argparse.Namespace(**{**vars(args), "num_prompts": args.warmup_requests, "seed": -1}), vocab
        )
        await run_workload(backend.stream, warm, float("inf"), args.max_concurrency, args.seed, False)
        before = phase_totals()
        results, duration = await run_workload(
            backend.stream,
            conversations(args, vocab),
            args.request_rate,
            args.max_concurrency,
            args.seed,
            not args.disable_tqdm,
        )
        after = phase_totals()
        if not isinstance(backend, EngineBackend):  # its session or channel belongs to this event loop
            await backend.aclose()
        return results, duration, before, after

    def phase_totals() -> dict[str, list[float]] | None:
        if isinstance(backend, EngineBackend):
            return backend.phase_totals()
        return scrape_phase_totals(metrics_url) if metrics_url else None

    results, duration, before, after = asyncio.run(bench())
    out = metrics(results, duration)
    if before is not None:  # the server's view: where the first token's time went
        for phase in PHASES:
            seconds, count = (after[phase][i] - before[phase][i] for i in range(2))
            out[f"server_mean_{phase}_ms"] = seconds / count * 1e3 if count else None
    return out


COST_METRICS = ("median_ttft_ms", "median_tpot_ms", "median_itl_ms")


def stack_cost(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """What the stack adds to the in-process engine, round by round (each round runs both on
    the same workload back to back) and at the median over rounds: milliseconds added to the
    latency medians, the relative change of output tokens/s."""
    cost: dict[str, Any] = {}
    for name in COST_METRICS:
        added = [r["stack"][name] - r["engine"][name] for r in rounds]
        cost[name.replace("_ms", "_added_ms")] = {"rounds": added, "median": statistics.median(added)}
    change = [r["stack"]["output_throughput"] / r["engine"]["output_throughput"] - 1 for r in rounds]
    cost["output_throughput_change"] = {"rounds": change, "median": statistics.median(change)}
    return cost


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def compare(args: argparse.Namespace, settings: dict[str, Any], vocab: int) -> dict[str, Any]:
    """The in-process engine and the stack alternated over `--compare-rounds` rounds (the order
    flips each round), so that drift of the machine falls on both. Each round draws its own
    prompts (`--seed` plus the round), the same for both sides: with one set for every round,
    the later rounds found their prompts in both engines' prefix caches and measured another
    workload than the first (on the CPU, round 1's TTFT was six times the later rounds')."""
    engine, (stack, metrics_url) = EngineBackend(settings, args.tp_size), make_backend(args, settings)
    rounds: list[dict[str, dict[str, Any]]] = []
    try:
        for i in range(args.compare_rounds):
            order = [("engine", engine), ("stack", stack)]
            workload = argparse.Namespace(**{**vars(args), "seed": args.seed + i})
            measured = {
                name: measure(backend, workload, vocab, metrics_url if name == "stack" else None)
                for name, backend in order[:: 1 if i % 2 == 0 else -1]
            }
            engine_r, stack_r = measured["engine"], measured["stack"]
            logger.info(
                "round %d: TTFT p50 engine %.2f ms, %s %.2f ms; output tok/s engine %.0f, %s %.0f; "
                "server queue / prefill means, ms: engine %s / %s, %s %s / %s",
                i + 1,
                engine_r["median_ttft_ms"],
                args.backend,
                stack_r["median_ttft_ms"],
                engine_r["output_throughput"],
                args.backend,
                stack_r["output_throughput"],
                *(_ms(engine_r.get(f"server_mean_{phase}_ms")) for phase in PHASES),
                args.backend,
                *(_ms(stack_r.get(f"server_mean_{phase}_ms")) for phase in PHASES),
            )
            rounds.append(measured)
    finally:
        engine.close()
    return {"rounds": rounds, "stack_cost": stack_cost(rounds)}


COLUMNS = [
    "completed",
    "failed",
    "concurrency",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "output_throughput",
    "mean_accept_length",
    "server_mean_queue_ms",
    "server_mean_prefill_ms",
    "median_ttft_added_ms",
    "output_throughput_change",
]


def workload(args: argparse.Namespace) -> str:
    """A run's case in a record: model (+ speculation), backend, replicas and ranks, the stack's
    router, streaming and transport where not the defaults, load, and the dataset's lengths."""
    model = os.path.basename(args.model.rstrip("/"))
    parts = [model + (f"+{args.speculative_algorithm}" if args.speculative_algorithm else "")]
    parts.append(f"{args.backend}-vs-engine" if args.compare_rounds else args.backend)
    parts += [f"r{args.num_replicas}"] * (args.num_replicas > 1) + [f"tp{args.tp_size}"] * (args.tp_size > 1)
    if args.backend != "engine":
        parts += [f"router-{args.router_policy}"] * (args.router_policy not in (None, DEFAULT_ROUTER))
        parts += [f"si{args.stream_interval}"] * (args.stream_interval != 1)
        parts += [f"rank0-{args.rank0_transport}"] * (args.rank0_transport != "socket")
    parts.append(f"c{args.max_concurrency}" if args.max_concurrency else f"rate{args.request_rate:g}")
    if args.dataset_name == "multi-turn":
        parts.append(f"turns{args.num_turns}")
    else:
        parts.append(f"in{args.random_input_len}-out{args.random_output_len}")
    return "/".join(parts)


def cases(out: dict[str, Any], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The recorded figures: a run's metrics, or with `--compare-rounds` the stack's cost at the
    median and per round, beside each side's TTFT median and output tokens/s per round."""
    if "stack_cost" not in out:
        return {workload(args): {k: v for k, v in out.items() if isinstance(v, (int, float)) and k != "cpus"}}
    cost = {k: v["median"] for k, v in out["stack_cost"].items()}
    cost.update({f"{k}_rounds": v["rounds"] for k, v in out["stack_cost"].items()})
    for side in ("engine", "stack"):
        for name in ("median_ttft_ms", "output_throughput"):
            cost[f"{side}_{name}_rounds"] = [r[side][name] for r in out["rounds"]]
    return {workload(args): cost}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO)  # the rounds of --compare-rounds as they end
    settings = engine_settings(args)
    with open(os.path.join(settings["model"], "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    out = {
        "backend": args.backend,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": torch.cuda.get_device_name() if args.device == "cuda" else platform.machine(),
        "cpus": os.cpu_count(),
        "settings": {
            k: v for k, v in vars(args).items() if k != "output_file" and not k.startswith(("record", "not_kept"))
        },
    }
    if args.compare_rounds:
        if args.backend == "engine":
            raise SystemExit("--compare-rounds: give the stack's --backend (grpc, http or openai)")
        out.update(compare(args, settings, vocab))
    else:
        backend, metrics_url = make_backend(args, settings)
        try:
            out.update(measure(backend, args, vocab, metrics_url))
        finally:
            if isinstance(backend, EngineBackend):
                backend.close()
    emit(out, args.output_file)
    record_run(args, "serve_bench", cases(out, args), COLUMNS, device=args.device)
    return out


if __name__ == "__main__":
    main()
