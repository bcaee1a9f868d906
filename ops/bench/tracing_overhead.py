"""Cost of step tracing: decode steps per second of the engine with and without a span per step
(plus its child spans per forward), exported by a BatchSpanProcessor to OTLP JSON-lines files.

    python -m ops.bench.tracing_overhead --requests 8 --max-new-tokens 96 --out result.json
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from cluster.config import TracingArgs
from cluster.tracing import engine_info, flush_all, record_step, tracer_for
from ops import DEFAULT_MODEL, DRAFT_MODELS
from ops.bench import emit
from ops.bench.record import add_record_args, record_run
from workers.engine import Engine, SamplingParams

PROMPT = [1] + list(range(100, 164))


def run(tracer, requests: int, max_new_tokens: int, algorithm: str) -> tuple[float, int]:
    eng = Engine(
        model=DEFAULT_MODEL,
        max_total_tokens=16384,
        speculative={"algorithm": algorithm, "draft_model": DRAFT_MODELS[algorithm], "num_steps": 4},
    )
    info = engine_info(eng)
    for i in range(requests):
        eng.add_request(
            [t + i for t in PROMPT], SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
        )
    steps, start = 0, time.perf_counter()
    while eng.has_unfinished():
        eng.step()
        steps += 1
        if tracer is not None:
            record_step(tracer, eng.last_step, [None] * len(eng.last_step.request_ids), info, eng.kv_stats(), 4)
    return time.perf_counter() - start, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--algorithm", default="eagle", choices=sorted(DRAFT_MODELS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    add_record_args(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tracer = tracer_for(TracingArgs(exporter="file", file_dir=tempfile.mkdtemp(prefix="trace_overhead_")), "bench")
    run(None, 1, 8, args.algorithm)  # warm-up
    rows = {"off": [], "on": []}
    for _ in range(args.repeats):
        for mode in ("off", "on"):
            seconds, steps = run(tracer if mode == "on" else None, args.requests, args.max_new_tokens, args.algorithm)
            rows[mode].append(seconds / steps)
    flush_all()
    off, on = min(rows["off"]), min(rows["on"])
    result = {
        "ms_per_step_off": round(off * 1e3, 3),
        "ms_per_step_on": round(on * 1e3, 3),
        "overhead_ms_per_step": round((on - off) * 1e3, 3),
        "overhead_percent": round(100 * (on - off) / off, 1),
        "requests": args.requests,
        "max_new_tokens": args.max_new_tokens,
        "algorithm": args.algorithm,
    }
    emit(result, args.out)
    record_run(args, "tracing_overhead", {args.algorithm: result}, device="cpu")


if __name__ == "__main__":
    main()
