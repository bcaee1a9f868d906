"""Steady decode steps of a model shape: the reading for before/after comparisons of a change.

    python -m ops.bench.decode_step --shape gemma3-1b --batch 1 --max-batch 64 --tag after
    python -m ops.bench.decode_step --shape gemma3-1b --against ../before --pairs 3
    python -m ops.bench.decode_step --shape gpt-oss-20b --variant mxfp4

One engine (dummy weights, CUDA graphs, the decode table's engine of `--max-batch` requests;
`--variant`: the shape's weights and KV as `decode_throughput --variants` stores them);
`--repeats` times: `--batch` requests of a 128-token prompt, 10 warm-up steps, then `--steps`
timed decode steps. Prints one JSON line of ms a step per repeat, and per repeat the share of
steps that found the device idle when the host came back for them (`starved`: near 0 when the
device sets the pace, near 1 when the host does); with `--replay-clock` also the median device
time of a graph replay (`graph_ms`) and between one replay and the next (`between_us`: what a
step costs the device outside its graph). Machines differ by up to 20%
and drift within minutes, so compare revisions in alternating processes on one machine:
`--against DIR` runs `--pairs` pairs of processes, this tree's and one with DIR first on the
path (another revision's `workers` and `attention`, e.g. `git archive REV workers attention |
tar x -C DIR`; `ops` comes from this tree), printing each line as it comes and the ratio of
the medians last.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import NamedTuple

import torch

from ops.bench.decode_throughput import PROMPT, SHAPES, VARIANTS, case_name, engine_for, random_prompts, write_config
from ops.bench.record import add_record_args, record_run
from workers.engine import Engine, SamplingParams

WARMUP_STEPS = 10
COLUMNS = ["median_ms", "ms_per_step", "starved", "graph_ms", "between_us", "this_over_against"]


class ReplayClock:
    """Timing events around every CUDA-graph replay while `running`: how long the graphs ran on
    the device, and the device time from one replay's end to the next one's start (the work a
    step queues outside its graph: copies in and out, kernels no graph holds). Two events a
    replay, so it is asked for (`--replay-clock`), not always on."""

    def __init__(self) -> None:
        self.marks: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        original = torch.cuda.CUDAGraph.replay

        def replay(graph: torch.cuda.CUDAGraph) -> None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            original(graph)
            end.record()
            self.marks.append((start, end))

        torch.cuda.CUDAGraph.replay = replay
        try:
            yield
        finally:
            torch.cuda.CUDAGraph.replay = original

    def medians(self) -> tuple[float, float]:
        """(ms a replay ran, us between a replay and the next), medians; the device drained."""
        inside = [start.elapsed_time(end) for start, end in self.marks]
        between = [end.elapsed_time(nxt) for (_, end), (nxt, _) in zip(self.marks, self.marks[1:])]
        return statistics.median(inside), 1e3 * statistics.median(between)


class Timed(NamedTuple):
    seconds: float
    starved: float  # share of steps the host began with the device already out of work


def timed_steps(engine: Engine, steps: int) -> Timed:
    """Seconds `steps` engine steps take, the device drained before and after; and how often the
    device had finished everything queued before the host came back for the next step (then
    the host, not the device, set the pace of that step). An event recorded after each step
    covers what it queued; querying it costs no synchronisation."""
    torch.cuda.synchronize()
    queued = torch.cuda.Event()
    starved = 0
    start = time.perf_counter()
    for i in range(steps):
        starved += i > 0 and queued.query()
        engine.step()
        queued.record()
    torch.cuda.synchronize()
    return Timed(time.perf_counter() - start, starved / max(1, steps - 1))


def finish(engine: Engine, rids: list[str]) -> None:
    """Run the requests to their end and release them (the pools back at their free counts)."""
    while engine.has_unfinished():
        engine.step()
    for rid in rids:
        engine.release(rid)


def steady_ms(
    engine: Engine, batch: int, steps: int, seed: int = 0, clock: ReplayClock | None = None
) -> tuple[float, float]:
    """Milliseconds a decode step over `steps` steps of `batch` running requests, and the share
    of them the device waited for the host; `clock` times those steps' replays."""
    sampling = SamplingParams(max_new_tokens=steps + 2 * WARMUP_STEPS, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request(p, sampling) for p in random_prompts(engine.cfg.vocab_size, batch, PROMPT, seed)]
    for _ in range(WARMUP_STEPS):
        engine.step()
    with clock.running() if clock is not None else contextlib.nullcontext():
        timed = timed_steps(engine, steps)
    finish(engine, rids)
    return 1e3 * timed.seconds / steps, timed.starved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="bf16")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--max-batch", type=int, default=64, help="the engine's max_running_requests")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tag", default="")
    parser.add_argument("--against", help="another checkout to alternate with, process by process")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument(
        "--replay-clock", action="store_true", help="time every graph replay: ms inside, us between replays"
    )
    add_record_args(parser)
    args = parser.parse_args()
    if args.against:
        record_run(args, "decode_step", compare(args), COLUMNS)
        return
    options, fields = VARIANTS[args.variant]
    config = write_config(tempfile.mkdtemp(), args.shape, {**SHAPES[args.shape], **fields})
    engine = engine_for(config, True, args.max_batch, **options)
    clocks = [ReplayClock() if args.replay_clock else None for _ in range(args.repeats)]
    runs = [steady_ms(engine, args.batch, args.steps, clock=clock) for clock in clocks]
    line = {"shape": case_name(args.shape, args.variant, PROMPT), "batch": args.batch, "max_batch": args.max_batch}
    line.update(ms_per_step=[ms for ms, _ in runs], starved=[share for _, share in runs], tag=args.tag)
    if args.replay_clock:
        medians = [clock.medians() for clock in clocks]
        line.update(graph_ms=[inside for inside, _ in medians], between_us=[gap for _, gap in medians])
    print(json.dumps(line))
    case = f"{line['shape']}/b{args.batch}" + (f"/{args.tag}" if args.tag else "")
    figures = {k: v for k, v in line.items() if k not in ("shape", "batch", "tag")}
    record_run(args, "decode_step", {case: {"median_ms": statistics.median(line["ms_per_step"]), **figures}}, COLUMNS)


def tree_process(tree: str, here: str, argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """The command and environment of a process that imports `tree`'s packages before `here`'s.

    `-P`: `python -m` would otherwise put the working directory (`here`) ahead of PYTHONPATH.
    """
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, here, os.environ.get("PYTHONPATH", "")]))
    return [sys.executable, "-P", "-m", "ops.bench.decode_step", *argv], env


def compare(args: argparse.Namespace) -> dict[str, dict]:
    """Alternate processes of this tree and of `args.against`; the ratio of their medians, and
    each side's readings as cases to record."""
    flags = ["--shape", args.shape, "--variant", args.variant, "--batch", str(args.batch)]
    flags += ["--max-batch", str(args.max_batch)]
    flags += ["--steps", str(args.steps), "--repeats", str(args.repeats)] + ["--replay-clock"] * args.replay_clock
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    trees = {"this": here, "against": os.path.abspath(args.against)}
    readings: dict[str, list[float]] = {tag: [] for tag in trees}
    for _ in range(args.pairs):
        for tag, tree in trees.items():
            cmd, env = tree_process(tree, here, [*flags, "--tag", tag])
            line = subprocess.run(cmd, env=env, cwd=here, check=True, capture_output=True, text=True).stdout
            print(line.strip(), flush=True)
            readings[tag] += json.loads(line.splitlines()[-1])["ms_per_step"]
    medians = {tag: statistics.median(ms) for tag, ms in readings.items()}
    ratio = medians["this"] / medians["against"]
    print(json.dumps({"median_ms": medians, "this_over_against": ratio}))
    case = f"{case_name(args.shape, args.variant, PROMPT)}/b{args.batch}"
    return {
        f"{case}/{tag}": {
            "median_ms": medians[tag],
            "ms_per_step": ms,
            **({"this_over_against": ratio} if tag == "this" else {}),
        }
        for tag, ms in readings.items()
    }


if __name__ == "__main__":
    main()
