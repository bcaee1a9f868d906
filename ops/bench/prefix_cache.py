"""Prefix caching: what the radix cache saves, in one engine and through Serve's routers.

    python -m ops.bench.prefix_cache --parts system_prompt,conversations --device cuda --out r.json
    python -m ops.bench.prefix_cache --parts routing --out r.json            # CPU, local Ray

- system_prompt: a hybrid-SWA shape with dummy weights (Gemma-3-1B by default): 64 requests
  sharing a 2,048-token system prompt, each with its own 64-token suffix, arriving together
  after one earlier request brought the prompt in and a first wave of 64 such requests warmed
  the kernels and the allocator. Time to first token (p50, p90) of the second wave with the
  cache on and off, and the prompt tokens each computed.
- conversations: 16 conversations x 4 turns (first prompt 512 tokens; each turn adds the 64
  generated tokens and 128 new ones); the turns of all conversations are batched. Prompt
  tokens computed with the cache on and off (a count: the same on any device).
- routing: two Serve replicas of the shipped tiny model with small KV pools; 8 tenants, each
  with its own system prompt, send requests in random order, 4 at a time. The share of prompt
  tokens the replicas found in their caches, under `round_robin` and `cache_aware` routing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from ops import DEFAULT_MODEL
from ops.bench import emit
from ops.bench.decode_throughput import SHAPES, write_config
from ops.bench.record import add_record_args, record_run
from workers.engine import Engine, SamplingParams

logger = logging.getLogger(__name__)


def _prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _engine(model: str, device: str, caching: bool, max_total_tokens: int, dummy: bool) -> Engine:
    return Engine(
        model=model,
        device=device,
        dtype="bfloat16" if device == "cuda" else "float32",
        load_format="dummy" if dummy else "auto",
        page_size=16,
        max_total_tokens=max_total_tokens,
        swa_full_tokens_ratio=0.5,
        chunked_prefill_size=8192,
        max_running_requests=64,
        enable_prefix_caching=caching,
    )


def _first_token_times(engine: Engine, prompts: list[list[int]], new: int) -> tuple[list[float], list[int]]:
    """Seconds from arrival to first token of requests arriving together, and their cached tokens."""
    sampling = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    rids = [engine.add_request(p, sampling) for p in prompts]
    first: dict[str, float] = {}
    while engine.has_unfinished():
        for rid, tokens, _ in engine.step():
            if tokens and rid not in first:
                if engine.device.type == "cuda":
                    torch.cuda.synchronize()
                first[rid] = time.perf_counter() - start
    cached = [engine.output(rid).cached_tokens for rid in rids]
    for rid in rids:
        engine.release(rid)
    return [first[rid] for rid in rids], cached


def system_prompt_part(model: str, device: str, dummy: bool, system_len: int, requests: int, suffix: int) -> dict:
    vocab = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
    (system,) = _prompts(vocab, [system_len], seed=1)
    prompts = [system + tail for tail in _prompts(vocab, [suffix] * (2 * requests + 1), seed=2)]
    warm, timed = prompts[1 : requests + 1], prompts[requests + 1 :]
    out = {}
    for caching in (False, True):
        engine = _engine(model, device, caching, (requests + 2) * (system_len + suffix + 64), dummy)
        _first_token_times(engine, prompts[:1], 1)  # the prompt enters the cache (when on)
        _first_token_times(engine, warm, 8)  # a wave of the same shape warms kernels and allocator either way
        times, cached = _first_token_times(engine, timed, 8)
        q = statistics.quantiles(times, n=10)
        out["on" if caching else "off"] = {
            "ttft_p50_ms": statistics.median(times) * 1e3,
            "ttft_p90_ms": q[8] * 1e3,
            "prompt_tokens": sum(map(len, timed)),
            "prompt_tokens_computed": sum(len(p) - c for p, c in zip(timed, cached)),
        }
        engine.shutdown()
    out["ttft_p50_on_over_off"] = out["on"]["ttft_p50_ms"] / out["off"]["ttft_p50_ms"]
    return out


def conversations_part(model: str, device: str, dummy: bool, convs: int, turns: int) -> dict:
    vocab = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
    first, added, new = 512, 128, 64
    out = {}
    for caching in (False, True):
        engine = _engine(model, device, caching, convs * (first + turns * (added + new) + 64) * 2, dummy)
        sampling = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
        prompts = _prompts(vocab, [first] * convs, seed=3)
        total = computed = 0
        for turn in range(turns):
            outs = engine.generate(prompt_token_ids=prompts, sampling=sampling)
            total += sum(map(len, prompts))
            computed += sum(len(p) - o.cached_tokens for p, o in zip(prompts, outs))
            extra = _prompts(vocab, [added] * convs, seed=10 + turn)
            prompts = [p + o.token_ids + e for p, o, e in zip(prompts, outs, extra)]
        out["on" if caching else "off"] = {"prompt_tokens": total, "prompt_tokens_computed": computed}
        engine.shutdown()
    out["computed_off_over_on"] = out["off"]["prompt_tokens_computed"] / out["on"]["prompt_tokens_computed"]
    return out


def routing_part(requests: int, tenants: int, system_len: int, concurrency: int) -> dict:
    import ray
    from ray import serve

    from cluster.app import build_app
    from cluster.client import GenerationClient

    vocab = json.load(open(os.path.join(DEFAULT_MODEL, "config.json")))["vocab_size"]
    systems = _prompts(vocab, [system_len] * tenants, seed=4)
    rng = random.Random(5)
    workload = [systems[rng.randrange(tenants)] + tail for tail in _prompts(vocab, [16] * requests, seed=6)]
    out = {}
    ray.init(address="local", num_cpus=8, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        for policy in ("round_robin", "cache_aware"):
            args = {
                "model": DEFAULT_MODEL,
                "num_replicas": 2,
                "cpus_per_rank": 0.5,
                "page_size": 16,
                "max_total_tokens": system_len * tenants * 3 // 4,  # a replica caches at most some tenants
                "router": {"policy": policy},
                "grpc": {"port": 0},
            }
            handle = serve.run(build_app(args), name=policy, route_prefix=None)
            client = GenerationClient(f"127.0.0.1:{handle.ports.remote().result()['grpc']}")

            def call(prompt: list[int], client=client):
                return client.complete(prompt, max_new_tokens=4, temperature=0.0, ignore_eos=True)

            start = time.perf_counter()
            with ThreadPoolExecutor(concurrency) as pool:
                responses = list(pool.map(call, workload))
            seconds = time.perf_counter() - start
            client.close()
            serve.delete(policy)
            prompt = sum(r.usage.prompt_tokens for r in responses)
            cached = sum(r.usage.cached_tokens for r in responses)
            out[policy] = {
                "cache_hit_rate": cached / prompt,
                "prompt_tokens": prompt,
                "cached_tokens": cached,
                "per_replica": {
                    rep: sum(r.replica == rep for r in responses) for rep in {r.replica for r in responses}
                },
                "seconds": seconds,
            }
    finally:
        serve.shutdown()
        ray.shutdown()
    return out


def _model(shape: str, root: str) -> tuple[str, bool]:
    """(model directory, dummy weights?) of a shape name or the shipped tiny model."""
    if shape == "tiny":
        return DEFAULT_MODEL, False
    return write_config(root, shape, SHAPES[shape]), True


COLUMNS = [
    "off/ttft_p50_ms",
    "on/ttft_p50_ms",
    "ttft_p50_on_over_off",
    "off/prompt_tokens_computed",
    "on/prompt_tokens_computed",
    "computed_off_over_on",
    "cache_hit_rate",
    "cached_tokens",
    "prompt_tokens",
    "per_replica",
]


def cases(result: dict) -> dict[str, dict]:
    """The recorded figures: each engine part under its shape, each routing policy (requests a
    replica as counts: the replicas' names are new every run)."""
    out = {f"{result['shape']}/{part}": result[part] for part in ("system_prompt", "conversations") if part in result}
    for policy, figures in result.get("routing", {}).items():
        out[f"routing/{policy}"] = {**figures, "per_replica": sorted(figures["per_replica"].values(), reverse=True)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="system_prompt,conversations,routing")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", default="gemma3-1b", help="a shape of ops.bench.decode_throughput, or tiny")
    parser.add_argument("--system-len", type=int, default=2048)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--out")
    add_record_args(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    parts = args.parts.split(",")
    result = {
        "benchmark": "prefix_cache",
        "date": datetime.date.today().isoformat(),
        "machine": torch.cuda.get_device_name()
        if args.device == "cuda"
        else platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "device": args.device,
    }
    if {"system_prompt", "conversations"} & set(parts):
        result["shape"] = args.shape
    with tempfile.TemporaryDirectory() as root:
        model, dummy = _model(args.shape, root)
        if "system_prompt" in parts:
            result["system_prompt"] = system_prompt_part(model, args.device, dummy, args.system_len, args.requests, 64)
        if "conversations" in parts:
            result["conversations"] = conversations_part(model, args.device, dummy, 16, 4)
    if "routing" in parts:
        result["routing"] = routing_part(requests=64, tenants=8, system_len=192, concurrency=4)
    emit(result, args.out)
    device = args.device if {"system_prompt", "conversations"} & set(parts) else "cpu"
    record_run(args, "prefix_cache", cases(result), COLUMNS, device=device)


if __name__ == "__main__":
    main()
