"""Where a decode step's time goes: torch.profiler over steady decode steps of a model shape.

    python -m ops.bench.profile_step --shapes llama3-8b,gemma3-1b --batches 1,64 --out profile.json
    python -m ops.bench.profile_step --shapes llama3-8b --variants bf16,fp8 --batches 1,8,64 --out profile.json

For each shape and batch (dummy weights, CUDA graphs on unless --eager, the decode workload of
`decode_throughput`): wall time per step, GPU-busy time per step (the union of kernel intervals:
what the device actually did), kernel launches per step, host synchronisations per step, and the
kernels that cost the most per step, by the time each adds after the kernels before it end
(under PDL a kernel's own interval includes its wait). With --speculative a step is a whole
draft-and-verify round. Wall well above GPU-busy means the host is the bottleneck; GPU-busy well
above the roofline names the kernels to fuse or replace.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

from ops.bench.decode_step import finish, timed_steps
from ops.bench.decode_throughput import (
    NEW,
    PROMPT,
    SHAPES,
    VARIANTS,
    case_name,
    draft_specs,
    engine_for,
    free,
    prefill,
    random_prompts,
    sync_sites,
    write_config,
)
from ops.bench.record import add_record_args, record_run
from workers.engine import Engine, SamplingParams

logger = logging.getLogger(__name__)
COLUMNS = [
    "wall_ms_per_step",
    "profiled_wall_ms_per_step",
    "gpu_busy_ms_per_step",
    "kernels_per_step",
    "syncs_per_step",
]


def added_us(intervals: list[tuple[float, float]]) -> list[float]:
    """What each [start, end) interval (sorted by start) adds to the union of those before it:
    the time the device is busy because of that kernel. Under programmatic dependent launch a
    kernel starts early and waits for the one before, so its own duration overstates its cost;
    the sum is the GPU-busy time."""
    added, reach = [], float("-inf")
    for start, end in intervals:
        added.append(max(0.0, end - max(start, reach)))
        reach = max(reach, end)
    return added


def idle_gaps(kernels: list, steps: int, top: int, least_us: float = 5.0) -> list[dict]:
    """Where the device sits idle between kernels: gaps of at least `least_us`, grouped by the
    kernels on either side (a gap inside a graph replay names two of its kernels; one before a
    replay names the host work it waited for)."""
    ordered = sorted((e.time_range.start, e.time_range.end, e.name) for e in kernels)
    groups: dict[tuple[str, str], list[float]] = {}
    reach, last = None, ""
    for start, end, name in ordered:
        if reach is not None and start - reach >= least_us:
            groups.setdefault((last[:60], name[:60]), []).append(start - reach)
        if reach is None or end > reach:
            reach, last = end, name
    ranked = sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:top]
    return [
        {"after": a, "before": b, "per_step": len(g) / steps, "us_per_step": sum(g) / steps} for (a, b), g in ranked
    ]


def profile_decode(engine: Engine, batch: int, steps: int, top: int, trace: str | None = None) -> dict:
    """Prefill `batch` prompts, warm up, then profile `steps` decode steps."""
    sampling = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request(p, sampling) for p in random_prompts(engine.cfg.vocab_size, batch, PROMPT)]
    prefill(engine)
    for _ in range(8):
        engine.step()
    sites = sync_sites(engine, 4)
    plain = timed_steps(engine, steps)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=trace is not None) as prof:
        wall = timed_steps(engine, steps).seconds
    finish(engine, rids)
    if trace:
        prof.export_chrome_trace(trace)
    return {
        "wall_ms_per_step": 1e3 * plain.seconds / steps,  # without the profiler
        "starved": plain.starved,  # steps that found the device idle (decode_step.timed_steps)
        "profiled_wall_ms_per_step": 1e3 * wall / steps,
        **kernel_summary(prof, steps, top),
        "sync_sites_per_4_steps": sites,
    }


def kernel_summary(prof: profile, steps: int, top: int) -> dict:
    """What the device did in a profile of `steps` steps: GPU-busy time, kernel launches and host
    synchronisations per step, the longest idle gaps and the `top` kernels by the time they add."""
    kernels = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda e: e.time_range.start
    )
    added = added_us([(e.time_range.start, e.time_range.end) for e in kernels])
    per_name: dict[str, list[tuple[float, float]]] = {}
    for e, a in zip(kernels, added):
        per_name.setdefault(e.name, []).append((e.time_range.end - e.time_range.start, a))
    ranked = sorted(per_name.items(), key=lambda kv: -sum(a for _, a in kv[1]))[:top]
    syncs = sum(
        e.count
        for e in prof.key_averages()
        if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
    )
    return {
        "gpu_busy_ms_per_step": sum(added) / 1e3 / steps,
        "kernels_per_step": len(kernels) / steps,
        "syncs_per_step": syncs / steps,
        "idle_gaps": idle_gaps(kernels, steps, top),
        "top_kernels": [  # ranked by the time they add (`added_us`); `us_per_step`: their own durations
            {
                "name": name[:120],
                "per_step": len(t) / steps,
                "added_us_per_step": sum(a for _, a in t) / steps,
                "us_per_step": sum(d for d, _ in t) / steps,
            }
            for name, t in ranked
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="llama3-8b,gemma3-1b")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--eager", action="store_true", help="profile without CUDA graphs")
    parser.add_argument(
        "--speculative",
        choices=["eagle", "eagle3", "frozen_kv_mtp", "eagle+map32k", "frozen_kv_mtp+map32k"],
        help="a dummy draft (llama3-8b only)",
    )
    parser.add_argument("--variants", default="bf16", help=f"weights and KV, of {', '.join(VARIANTS)}, comma-separated")
    parser.add_argument("--trace", help="also write a Chrome trace per run, named from this prefix")
    parser.add_argument("--out", required=True)
    add_record_args(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    root, results = tempfile.mkdtemp(prefix="shapes-"), {"device": torch.cuda.get_device_name()}
    batches = [int(b) for b in args.batches.split(",")]
    unknown = sorted(set(args.variants.split(",")) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    for shape, variant in itertools.product(args.shapes.split(","), args.variants.split(",")):
        spec = draft_specs(root)[args.speculative] if args.speculative else None
        options, fields = VARIANTS[variant]
        name = case_name(shape, variant, PROMPT)
        path = write_config(root, name, {**SHAPES[shape], **fields})
        engine = engine_for(path, graphs=not args.eager, max_batch=max(batches), speculative=spec, **options)
        for batch in batches:
            trace = f"{args.trace}-{name}-b{batch}.json" if args.trace else None
            r = profile_decode(engine, batch, args.steps, args.top, trace)
            results[f"{name}/b{batch}{'/' + args.speculative if spec else ''}"] = r
            logger.info(
                "%s b%d: wall %.2f ms (%.2f profiled), GPU busy %.2f ms, %.0f kernels, %.1f syncs per step",
                name,
                batch,
                r["wall_ms_per_step"],
                r["profiled_wall_ms_per_step"],
                r["gpu_busy_ms_per_step"],
                r["kernels_per_step"],
                r["syncs_per_step"],
            )
            for site, n in r["sync_sites_per_4_steps"].items():
                logger.info("    sync x%d in 4 steps: %s", n, site)
            for k in r["top_kernels"]:
                logger.info(
                    "    adds %8.1f us (runs %8.1f)  %5.1f x  %s",
                    k["added_us_per_step"],
                    k["us_per_step"],
                    k["per_step"],
                    k["name"],
                )
            for g in r["idle_gaps"]:
                logger.info(
                    "    idle %7.1f us  %5.1f x  after %s  before %s",
                    g["us_per_step"],
                    g["per_step"],
                    g["after"],
                    g["before"],
                )
        free(engine)
        del engine
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    record_run(args, "profile_step", {k: v for k, v in results.items() if isinstance(v, dict)}, COLUMNS)


if __name__ == "__main__":
    main()
