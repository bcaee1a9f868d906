"""Host time of a decode step: plain decoding against each draft held at plain steps, where a
tiny model's step is mostly host work.

    python -m ops.bench.host_step --out host_step.json [--device cuda] [--batches 1,16,64] [--record]

One engine without a draft and one per shipped draft (standalone, EAGLE, frozen-KV MTP), all with
overlapped decoding. On the CPU (the default) the graphs are emulated, the code path a GPU runs,
and after a warm-up run each graph's forward returns its first output instead of running the model
(and writes nothing into an EAGLE engine's hidden ring, as a captured graph does on the device), so
what a step costs is what the host does for it: scheduling, staging the replay, committing tokens,
and for a draft engine its worker's and controller's bookkeeping (the draft's catch-ups, eager,
still run the model). With `--device cuda` the graphs are captured and replayed on the GPU, whose
work on a tiny model takes less than the host's, so a step's time is still the host's. Draft
engines run the adaptive controller with rounds priced far above a plain step, starting at plain
steps, so they stay there as they would where speculation does not pay (a controller starting at
rounds would price them from its first steps, whose time in turns holds the other engines' steps
too: plain steps look that much dearer); with `--round-steps K`, a draft engine's steps are rounds
of K draft steps instead (`<draft>/kK`: the host work of a round; on the CPU the device's outputs
repeat, so each round accepts what the first did).

At each batch, `--repeats` rounds: every engine is given the batch's requests of `--new` tokens,
then the engines take one step each, in a new random order every time, until all are done (a
host's speed drifts by more than the differences sought between runs even seconds apart, and
within a step's neighbourhood hardly at all). A case is the median of its decode steps over the
rounds (`p50_us`), with `over_plain_us` the median difference between a draft engine's step and
plain decoding's step of the same turn; `mean_us` and `over_plain_mean_us` are their means (what
throughput sees: a median leaves out the few steps that decide or catch up). `calls`: Python
function calls a step (counted by cProfile over one more run; the same on every machine, unlike
microseconds).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import logging
import pstats
import random
import statistics
import time
from collections.abc import Iterator

import torch

from ops import DEFAULT_MODEL, DRAFT_MODELS
from ops.bench.decode_throughput import timed_decode
from ops.bench.record import add_record_args, record_run, write_out
from workers.cuda_graphs import CudaGraphRunner
from workers.engine import Engine, SamplingParams
from workers.speculative.controller import FixedDraftSteps

BATCHES = (1, 16, 64)
PROMPT = 64
TOKENS_A_REQUEST = 700  # the KV an engine holds a request: its prompt and new tokens
COLUMNS = ["p50_us", "over_plain_us", "mean_us", "over_plain_mean_us", "calls", "calls_over_plain"]
ROUND_SECONDS = 1.0  # what a draft engine's controller is told a round costs: plain steps throughout


def build(batch: int, draft: str | None, round_steps: int = 0, device: str = "cpu") -> Engine:
    """An engine of `batch` requests on `device` (the CPU: graphs emulated); with `draft`,
    adaptive and priced to stay at plain steps, or with `round_steps`, rounds of that many draft
    steps."""
    spec = None if draft is None else {"algorithm": draft, "draft_model": DRAFT_MODELS[draft], "num_steps": 4}
    engine = Engine(
        model=DEFAULT_MODEL,
        device=device,
        page_size=16,
        attention_backend="trtllm_mha",
        max_total_tokens=batch * TOKENS_A_REQUEST,
        max_running_requests=batch,
        cuda_graphs="emulate" if device == "cpu" else True,
        overlap_schedule=True,
        speculative=spec,
    )
    if draft is not None and round_steps:
        engine.spec.controller = FixedDraftSteps(round_steps)
    elif draft is not None:
        controller = engine.spec.controller
        for bucket in controller.costs.buckets:
            for k in range(1, controller.num_steps + 1):
                controller.costs.measured[(bucket, k)] = ROUND_SECONDS
        controller.k = 0
    return engine


@contextlib.contextmanager
def device_work_taken_out() -> Iterator[None]:
    """Each emulated graph's forward returns its first output (per runner and graph) from now on,
    and writes no hidden states into a ring (a captured graph's own work on a GPU)."""
    forward, write_ring, first = CudaGraphRunner._forward, CudaGraphRunner._write_ring, {}

    def replayed(runner, key, family, static):
        if (id(runner), key) not in first:
            first[(id(runner), key)] = forward(runner, key, family, static)
        return first[(id(runner), key)]

    CudaGraphRunner._forward, CudaGraphRunner._write_ring = replayed, lambda runner, family, hidden: None
    try:
        yield
    finally:
        CudaGraphRunner._forward, CudaGraphRunner._write_ring = forward, write_ring


def prompts(batch: int) -> list[list[int]]:
    """`batch` prompts of PROMPT token ids, each its own."""
    return [[5 + (i * 7 + j) % 2000 for j in range(PROMPT)] for i in range(batch)]


def step_us(engine: Engine, batch: int, new: int) -> list[float]:
    """Microseconds between consecutive decode steps of one run."""
    ends: list[int] = []
    sampling = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    timed_decode(engine, prompts(batch), sampling, lambda: ends.append(time.perf_counter_ns()))
    return [(b - a) / 1e3 for a, b in zip(ends, ends[1:])]


def calls_per_step(engine: Engine, batch: int, new: int) -> float:
    """Python function calls a decode step, over one run (cProfile's primitive and other calls)."""
    profile = cProfile.Profile()
    profile.enable()
    steps = len(step_us(engine, batch, new)) + 1
    profile.disable()
    return sum(entry[1] for entry in pstats.Stats(profile).stats.values()) / steps


def turns(engines: dict[str, Engine], batch: int, new: int, rng: random.Random) -> dict[str, list[float]]:
    """One round: each engine given `batch` requests of `new` tokens, then stepped once each, in a
    new random order every turn, until all are done; each engine's decode step times (us, in turn
    order: its prefill and the first and last decode steps, a launch and a drain, left out)."""
    sampling = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    for engine in engines.values():
        for prompt in prompts(batch):
            engine.add_request(prompt, sampling)
    return {name: [ns / 1e3 for _, ns in steps[2:-1]] for name, steps in in_turns(engines, rng).items()}


def in_turns(engines: dict[str, Engine], rng: random.Random) -> dict[str, list[tuple[int | None, int]]]:
    """Step the engines once each, in a new random order every turn, until all are done; each
    engine's calls as (its last step's draft steps, nanoseconds the call took)."""
    calls: dict[str, list[tuple[int | None, int]]] = {name: [] for name in engines}
    order = list(engines.items())
    while any(engine.has_unfinished() for engine in engines.values()):
        rng.shuffle(order)
        for name, engine in order:
            if engine.has_unfinished():
                start = time.perf_counter_ns()
                engine.step()
                took = time.perf_counter_ns() - start
                calls[name].append((engine.last_step.draft_steps, took))
    return calls


def measure(
    batch: int, drafts: list[str], new: int, repeats: int, round_steps: int = 0, device: str = "cpu"
) -> dict[str, dict]:
    """Each engine's median step over `repeats` rounds of turns, set against plain decoding's
    step of the same turn; with `round_steps`, a draft engine's step is a round of that many
    draft steps (`<draft>/k<n>`)."""
    named = {d if not round_steps else f"{d}/k{round_steps}": d for d in drafts}
    engines = {
        "plain": build(batch, None, device=device),
        **{name: build(batch, d, round_steps, device) for name, d in named.items()},
    }
    for engine in engines.values():  # the first replays of each graph, with the model
        step_us(engine, batch, 8)
    rng = random.Random(0)
    with device_work_taken_out() if device == "cpu" else contextlib.nullcontext():
        turns(engines, batch, new, rng)  # (a warm-up)
        cases = set_against_plain([turns(engines, batch, new, rng) for _ in range(repeats)])
        for name, engine in engines.items():
            cases[name]["calls"] = calls_per_step(engine, batch, new)
    for name, case in cases.items():
        if name != "plain":
            case["calls_over_plain"] = case["calls"] - cases["plain"]["calls"]
            case["draft_steps"] = getattr(engines[name].spec.controller, "k", round_steps)
    for engine in engines.values():
        engine.shutdown()
    return {f"b{batch}/{name}": case for name, case in cases.items()}


def set_against_plain(rounds: list[dict[str, list[float]]]) -> dict[str, dict]:
    """Each engine's median and mean step over `rounds` (each engine's step times in turn order),
    and a draft engine's median and mean difference from plain decoding's step of the same turn."""
    cases = {}
    for name in rounds[0]:
        steps = [t for run in rounds for t in run[name]]
        cases[name] = {"p50_us": statistics.median(steps), "mean_us": statistics.fmean(steps), "steps": len(steps)}
        if name != "plain":
            over = [t - p for run in rounds for t, p in zip(run[name], run["plain"])]
            cases[name]["over_plain_us"] = statistics.median(over)
            cases[name]["over_plain_mean_us"] = statistics.fmean(over)
    return cases


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the cases as JSON here too")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--drafts", default=",".join(DRAFT_MODELS), help="drafts to run, comma-separated")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--new", type=int, default=200, help="new tokens a request a run")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--round-steps", type=int, default=0, help="time rounds of this many draft steps instead of plain steps"
    )
    add_record_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    results: dict[str, dict] = {}
    for batch in (int(b) for b in args.batches.split(",")):
        cases = measure(batch, args.drafts.split(","), args.new, args.repeats, args.round_steps, args.device)
        results.update(cases)
        for key, case in cases.items():
            extra = ""
            if "over_plain_us" in case:
                extra = (
                    f"  +{case['over_plain_us']:.1f} us (mean +{case['over_plain_mean_us']:.1f}),"
                    f" +{case['calls_over_plain']:.1f} calls"
                )
            times = f"p50 {case['p50_us']:8.1f} us  mean {case['mean_us']:8.1f} us"
            print(f"{key:<24} {times}  {case['calls']:7.1f} calls{extra}", flush=True)
    write_out(args.out, results)
    record_run(args, "host_step", results, COLUMNS, device=args.device)


if __name__ == "__main__":
    main()
