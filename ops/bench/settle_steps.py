"""Decode steps by their place after a change between plain steps and rounds: how many of them the
adaptive controller should leave untimed (`AdaptiveDraftSteps.settle_steps`).

    python -m ops.bench.settle_steps --out settle.json [--device cuda] [--batches 1,16] [--pin-cpu N] [--record]

The shipped tiny target with each draft (`--drafts`, default EAGLE and the frozen-KV MTP head),
built as `host_step` builds it: overlapped decoding, graphs captured on a GPU (emulated on the
CPU: a smoke run). A scripted controller alternates `--rounds` rounds of `--k` draft steps with
`--plain` plain steps, so that every stretch starts right after a change. Beside it, an engine of
the same draft held at plain steps throughout (never a round: what plain steps cost an engine
that has not run any) is given the same requests, and the two take one step each, in a new random
order every turn (a host's speed drifts by more than the differences sought between runs seconds
apart), for `--repeats` runs of `--new` tokens a request. Each decode step is timed from the end of
the engine's step before (as the controller times it), counting only that engine's own calls. A
case is a draft and batch: the median of the steps at each place after a change (`plain_us`: plain
steps 2-4, 5-8, 9-16, 17-32 and 33 on after rounds; `round_us`: rounds 2, 3-4 and 5 on after plain
steps), each band against the last, the steady steps (`plain_over_steady`, `round_over_steady`),
and the plain bands against the held engine's median plain step (`held_us`, `plain_over_held`: a
band still over 1 from 33 on is a slowdown that outlasts what the controller leaves untimed, which
its plain-step figure then carries). The first step after a change is left out (its time holds the other
kind's last work: the launch that restarts overlapped plain steps, the drain and catch-up before a
round); the controller counts it towards the change anyway.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import logging
import random
import statistics

import torch

from ops.bench import host_step
from ops.bench.adaptive_spec import pin_cpu
from ops.bench.decode_throughput import prefill, timed_decode
from ops.bench.record import add_record_args, record_run, write_out
from workers.engine import Engine, SamplingParams

PLAIN_BANDS = ((2, 4), (5, 8), (9, 16), (17, 32), (33, None))  # places after a change (the first left out)
ROUND_BANDS = ((2, 2), (3, 4), (5, None))


def band_name(first: int, last: int | None) -> str:
    return str(first) if first == last else f"{first}-{last or 'on'}"


COLUMNS = (
    [f"plain_over_steady/{band_name(*b)}" for b in PLAIN_BANDS[:-1]]
    + [f"round_over_steady/{band_name(*b)}" for b in ROUND_BANDS[:-1]]
    + [f"plain_over_held/{band_name(*b)}" for b in PLAIN_BANDS]
)


@dataclasses.dataclass
class AlternatingDraftSteps:
    """A controller that runs `rounds` rounds of `k` draft steps, then `plain` plain steps, in turn,
    counted in steps told (the launch that restarts overlapped plain steps is not told: a stretch
    of plain steps runs one more)."""

    rounds: int
    plain: int
    k: int
    told: int = 0

    def choose(self, batch_size: int, expected_tokens) -> int:
        return self.k if self.told % (self.rounds + self.plain) < self.rounds else 0

    def observe(self, batch_size: int, k: int, seconds: float | None, clean: bool = True) -> None:
        self.told += 1


def places(steps: list[tuple[int | None, int]]) -> tuple[dict[int, list[float]], dict[int, list[float]]]:
    """Microseconds of each decode step (from the end of the step before) by its place after the
    last change of kind, plain steps and rounds apart: `steps` are (draft steps, end ns) in order
    (None: a step that decoded nothing, as the drain of overlapped plain steps before a round: no
    place of its own). The first step after a change is left out (its time holds the other kind's
    last work), and so is each run's first stretch (no change before it)."""
    plain: dict[int, list[float]] = {}
    rounds: dict[int, list[float]] = {}
    kind, place, changed = None, 0, False
    for (_, before), (k, end) in zip(steps, steps[1:]):
        if k is None:
            continue
        if (k > 0) != kind:
            changed, kind, place = kind is not None, k > 0, 0
        place += 1
        if changed and place > 1:
            (rounds if kind else plain).setdefault(place, []).append((end - before) / 1e3)
    return plain, rounds


def bands(by_place: dict[int, list[float]], edges) -> dict[str, float]:
    """The median of the steps in each band of places (`edges`: first and last place, None: on)."""
    out = {}
    for first, last in edges:
        times = [t for place, ts in by_place.items() if place >= first and (last is None or place <= last) for t in ts]
        if times:
            out[band_name(first, last)] = statistics.median(times)
    return out


def over_steady(band_us: dict[str, float]) -> dict[str, float]:
    """Each band against the last (the steady steps)."""
    if not band_us:
        return {}
    steady = band_us[list(band_us)[-1]]
    return {band: us / steady for band, us in band_us.items()}


def held_plain_us(steps: list[tuple[int | None, int]]) -> list[float]:
    """Microseconds of each plain step of an engine that ran nothing else (`steps` as `places`
    takes them), but its first (the launch that starts overlapped plain steps goes with it)."""
    return [(end - before) / 1e3 for (_, before), (k, end) in zip(steps, steps[1:]) if k == 0][1:]


def interleaved(
    engines: dict[str, Engine], prompts: list[list[int]], sampling: SamplingParams, rng: random.Random
) -> dict[str, list[tuple[int | None, int]]]:
    """Each engine given `prompts` and prefilled, then stepped once each, in a new random order
    every turn, until all are done; each engine's decode steps as (draft steps, end ns) on a clock
    of its own calls alone, so that another engine's step between two of its own is not counted
    (the requests' records are released)."""
    rids = {name: [engine.add_request(p, sampling) for p in prompts] for name, engine in engines.items()}
    for engine in engines.values():
        prefill(engine)
    steps = {
        name: list(zip((k for k, _ in calls), itertools.accumulate(ns for _, ns in calls)))
        for name, calls in host_step.in_turns(engines, rng).items()
    }
    for name, engine in engines.items():
        for rid in rids[name]:
            engine.release(rid)
    return steps


def measure(draft: str, batch: int, args: argparse.Namespace) -> dict:
    """One draft and batch: the scripted engine and the held one, a warm-up run each, then
    `args.repeats` runs stepped in turns."""
    scripted = host_step.build(batch, draft, args.k, args.device)
    scripted.spec.controller = AlternatingDraftSteps(args.rounds, args.plain, args.k)
    engines = {"scripted": scripted, "held": host_step.build(batch, draft, device=args.device)}
    prompts = host_step.prompts(batch)
    for engine in engines.values():
        timed_decode(engine, prompts, SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True))
    plain: dict[int, list[float]] = {}
    rounds: dict[int, list[float]] = {}
    held: list[float] = []
    sampling = SamplingParams(max_new_tokens=args.new, temperature=0.0, ignore_eos=True)
    rng = random.Random(0)
    for _ in range(args.repeats):
        steps = interleaved(engines, prompts, sampling, rng)
        p, r = places(steps["scripted"])
        for into, got in ((plain, p), (rounds, r)):
            for place, times in got.items():
                into.setdefault(place, []).extend(times)
        held.extend(held_plain_us(steps["held"]))
    for engine in engines.values():
        engine.check_no_leak()
        engine.shutdown()
    plain_us, round_us, held_us = bands(plain, PLAIN_BANDS), bands(rounds, ROUND_BANDS), statistics.median(held)
    return {
        "plain_us": plain_us,
        "round_us": round_us,
        "held_us": held_us,
        "plain_over_steady": over_steady(plain_us),
        "round_over_steady": over_steady(round_us),
        "plain_over_held": {band: us / held_us for band, us in plain_us.items()},
        "plain_steps": sum(map(len, plain.values())),
        "rounds": sum(map(len, rounds.values())),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the cases as JSON here too")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--drafts", default="eagle,frozen_kv_mtp", help="drafts to run, comma-separated")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--rounds", type=int, default=24, help="rounds a stretch")
    parser.add_argument("--plain", type=int, default=96, help="plain steps a stretch")
    parser.add_argument("--k", type=int, default=4, choices=range(1, 5), help="draft steps a round")
    most = host_step.TOKENS_A_REQUEST - host_step.PROMPT
    parser.add_argument("--new", type=int, default=512, help=f"new tokens a request a run (1 to {most})")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--pin-cpu", type=int, default=None, help="run the process on this CPU alone")
    add_record_args(parser)
    args = parser.parse_args(argv)
    if not 1 <= args.new <= most:
        parser.error(f"--new: {args.new}, but a request holds 1 to {most} new tokens beside its prompt")
    logging.basicConfig(level=logging.WARNING)
    if args.pin_cpu is not None:
        pin_cpu(args.pin_cpu)
    if args.device == "cpu":
        torch.set_num_threads(1)
    results = {}
    for draft in args.drafts.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            case = results[f"{draft}/b{batch}"] = measure(draft, batch, args)
            plain = " ".join(f"{b} {v:.2f}" for b, v in case["plain_over_steady"].items())
            rounds = " ".join(f"{b} {v:.2f}" for b, v in case["round_over_steady"].items())
            held = " ".join(f"{b} {v:.2f}" for b, v in case["plain_over_held"].items())
            print(
                f"{draft}/b{batch}: plain steps after rounds {plain} | rounds after plain {rounds}"
                f" | plain steps after rounds over held ({case['held_us']:.0f} us) {held}",
                flush=True,
            )
    write_out(args.out, results)
    record_run(args, "settle_steps", results, COLUMNS, device=args.device)


if __name__ == "__main__":
    main()
