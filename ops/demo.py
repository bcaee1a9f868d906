"""`slidespec demo`: the whole system on one machine, in a few minutes on two CPU cores.

Starts a local Ray cluster (loopback only), deploys the Serve application on a shipped tiny
hybrid-SWA set with speculative decoding on `trtllm_mha` (its reference kernels on a CPU): by
default Gemma 4 drafted by its assistant over the target's frozen KV, the scenario of the upstream
bugs (docs/design.md §4), or `--models gemma3` with its three drafts. Sends concurrent gRPC
requests, prints their completions, tokens/s and accept lengths, says where the traces and
metrics went (and what `slidespec diagnose` makes of the traces), then shuts everything down.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import tempfile
import time

from ops import TINY_SETS
from ops.cli import positive
from ops.local_ray import keep_ray_on_loopback, start_local_ray

logger = logging.getLogger("slidespec.demo")

PROMPTS = [
    "def fibonacci(n):\n    ",
    "import os\nimport sys\n\n\ndef main(argv):\n    ",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        ",
    "for i in range(10):\n    if i % 2 == 0:\n        ",
    "    def __repr__(self):\n        return ",
    "try:\n    import json\nexcept ImportError:\n    ",
    "with open(path, 'rb') as f:\n    data = ",
    "def parse_args(args=None):\n    parser = argparse.ArgumentParser(",
]


ALGORITHMS = {"gemma4": "mtp", "gemma3": "eagle"}  # each set's default draft


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--models", default="gemma4", choices=list(TINY_SETS), help="the shipped tiny set: target and drafts"
    )
    parser.add_argument(
        "--algorithm",
        default=None,
        choices=sorted({a for _, drafts in TINY_SETS.values() for a in drafts}),
        help="speculative decoding with the set's draft for this algorithm (gemma4: mtp, its assistant; "
        "gemma3: standalone, eagle, frozen_kv_mtp; default mtp and eagle)",
    )
    parser.add_argument("--attention-backend", default="trtllm_mha", choices=["trtllm_mha", "torch_native"])
    parser.add_argument("--num-steps", type=positive, default=4, help="draft tokens per round")
    parser.add_argument("--requests", type=positive, default=len(PROMPTS), help="concurrent requests")
    parser.add_argument("--max-new-tokens", type=positive, default=96)
    parser.add_argument("--replicas", type=positive, default=1)
    parser.add_argument("--tp-size", type=positive, default=1)
    parser.add_argument("--trace-dir", default=None, help="where OTLP JSON-lines traces go (default: a new temp dir)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _send(target: str, prompts: list[str], max_new_tokens: int) -> list[dict]:
    from cluster.client import AsyncGenerationClient

    client = AsyncGenerationClient(target)

    async def one(i: int, prompt: str) -> dict:
        start, first, text, last = time.perf_counter(), None, "", None
        async for response in client.generate(
            prompt, request_id=f"demo-{i}", max_new_tokens=max_new_tokens, temperature=0.0
        ):
            first = first or time.perf_counter()
            text += response.text
            last = response
        return {
            "prompt": prompt,
            "text": text,
            "tokens": last.usage.completion_tokens,
            "replica": last.replica,
            "accept_length": last.spec.mean_accept_length,
            "verify_steps": last.spec.verify_steps,
            "ttft_s": first - start,
            "seconds": time.perf_counter() - start,
        }

    try:
        return await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])
    finally:
        await client.close()


def _openai_chat(base_url: str, model: str) -> None:
    """One chat completion through the OpenAI-compatible API (what the `openai` client sends)."""
    import requests

    body = {"model": model, "messages": [{"role": "user", "content": "def fibonacci(n):"}], "max_tokens": 32}
    out = requests.post(f"{base_url}/chat/completions", json={**body, "temperature": 0}, timeout=60).json()
    shown = out["choices"][0]["message"]["content"].replace("\n", "\n    | ")
    print(
        f"--- OpenAI API: POST {base_url}/chat/completions, {out['usage']['completion_tokens']} tokens, "
        f"finish {out['choices'][0]['finish_reason']}\n    | {shown}\n"
    )


def run(args: argparse.Namespace) -> int:
    model, drafts = TINY_SETS[args.models]
    algorithm = args.algorithm or ALGORITHMS[args.models]
    if algorithm not in drafts:
        raise ValueError(f"--algorithm: {algorithm!r} has no shipped {args.models} draft; choose from {sorted(drafts)}")
    keep_ray_on_loopback()
    import ray
    import requests
    from ray import serve

    from cluster.app import build_app
    from ops.diagnose import diagnose

    trace_dir = args.trace_dir or tempfile.mkdtemp(prefix="slidespec-traces-")
    http_port = _free_port()
    app_args = dict(
        model=model,
        attention_backend=args.attention_backend,
        tp_size=args.tp_size,
        num_replicas=args.replicas,
        page_size=16,
        max_total_tokens=16384,
        chunked_prefill_size=256,
        max_running_requests=32,
        speculative={"algorithm": algorithm, "draft_model": drafts[algorithm], "num_steps": args.num_steps},
        router={"policy": "cache_aware"},
        grpc={"port": 0},
        tracing={"exporter": "file", "file_dir": trace_dir},
    )
    print(
        f"starting a local Ray cluster and the Serve app: {os.path.basename(model)} + {algorithm} draft "
        f"({os.path.basename(drafts[algorithm])}, {args.num_steps} steps) on {args.attention_backend}, "
        f"{args.replicas} replica(s) x tp {args.tp_size}"
    )
    start_local_ray(
        num_cpus=max(8, 2 * args.replicas * (args.tp_size + 1) + 2),
        log_to_driver=False,
        configure_logging=False,
        runtime_env={"env_vars": {"OTEL_BSP_SCHEDULE_DELAY": "500"}},
    )
    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        start = time.perf_counter()
        ingress = serve.run(build_app(app_args), name="slidespec", route_prefix="/")
        grpc_port = ingress.ports.remote().result()["grpc"]
        print(
            f"up in {time.perf_counter() - start:.1f} s: gRPC on 127.0.0.1:{grpc_port}, HTTP on 127.0.0.1:{http_port}\n"
        )
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
        start = time.perf_counter()
        results = asyncio.run(_send(f"127.0.0.1:{grpc_port}", prompts, args.max_new_tokens))
        elapsed = time.perf_counter() - start
        for i, r in enumerate(results):
            shown = (r["prompt"] + r["text"]).replace("\n", "\n    | ")
            print(
                f"--- demo-{i}: {r['tokens']} tokens, accept length {r['accept_length']:.2f} over {r['verify_steps']} "
                f"verify steps, first token {r['ttft_s'] * 1e3:.0f} ms, replica {r['replica']}\n    | {shown}\n"
            )
        total = sum(r["tokens"] for r in results)
        steps = sum(r["verify_steps"] for r in results)
        mean = sum(r["accept_length"] * r["verify_steps"] for r in results) / max(1, steps)
        print(
            f"{len(results)} requests, {total} tokens in {elapsed:.2f} s = {total / elapsed:.1f} tokens/s; "
            f"mean accept length {mean:.2f}"
        )
        _openai_chat(f"http://127.0.0.1:{http_port}/v1", os.path.basename(model))
        metrics = requests.get(f"http://127.0.0.1:{http_port}/metrics", timeout=30).text
        shown = [
            line
            for line in metrics.splitlines()
            if line.startswith(
                (
                    "slidespec_spec_accept_length",
                    "slidespec_spec_accept_rate",
                    "slidespec_spec_decode_num_drafts_total",
                    "slidespec_spec_decode_num_accepted_tokens_total",
                    "slidespec_time_to_first_token_seconds_count",
                )
            )
        ]
        print(f"\nmetrics: http://127.0.0.1:{http_port}/generate/metrics (Prometheus), for example:")
        print("\n".join(f"  {line}" for line in shown))
    finally:
        serve.shutdown()
        ray.shutdown()
    time.sleep(1.0)  # the rank actors' last span batches
    print(f"\ntraces: {trace_dir} (OTLP JSON lines); `slidespec diagnose {trace_dir}` says:")
    try:
        text, _ = diagnose([trace_dir], os.path.join(trace_dir, "accept_length.png"))
        lines = text.splitlines()
        summary = [lines[0]] + [
            line for line in lines if line.startswith(("acceptance by", "no accept", "DROP", "  slidespec."))
        ]
        print("\n".join(f"  {line}" for line in summary))
        print(f"  plot: {os.path.join(trace_dir, 'accept_length.png')}")
    except ValueError as exc:
        print(f"  {exc}")
    return 0
