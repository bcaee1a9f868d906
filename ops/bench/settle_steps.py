"""Decode steps by their place after a change between plain steps and rounds: how many of them the
adaptive controller should leave untimed (`AdaptiveDraftSteps.settle_steps`).

    python -m ops.bench.settle_steps --out settle.json [--device cuda] [--batches 1,16] [--record]

The shipped tiny target with each draft (`--drafts`, default EAGLE and the frozen-KV MTP head),
built as `host_step` builds it: overlapped decoding, graphs captured on a GPU (emulated on the
CPU: a smoke run). A scripted controller alternates `--rounds` rounds of `--k` draft steps with
`--plain` plain steps, so that every stretch starts right after a change; `--repeats` runs of
`--new` tokens a request. Each decode
step is timed from the end of the step before (as the controller times it). A case is a draft and
batch: the median of the steps at each place after a change (`plain_us`: plain steps 2-4, 5-8,
9-16, 17-32 and 33 on after rounds; `round_us`: rounds 2, 3-4 and 5 on after plain steps) and each
band against the last, the steady steps (`plain_over_steady`, `round_over_steady`). The first step
after a change is left out (its time holds the other kind's last work: the launch that restarts
overlapped plain steps, the drain and catch-up before a round); the controller counts it towards
the change anyway.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import statistics

import torch

from ops.bench import host_step
from ops.bench.decode_throughput import timed_decode
from ops.bench.record import add_record_args, record_run, write_out
from workers.engine import Engine, SamplingParams

PLAIN_BANDS = ((2, 4), (5, 8), (9, 16), (17, 32), (33, None))  # places after a change (the first left out)
ROUND_BANDS = ((2, 2), (3, 4), (5, None))


def band_name(first: int, last: int | None) -> str:
    return str(first) if first == last else f"{first}-{last or 'on'}"


COLUMNS = [f"plain_over_steady/{band_name(*b)}" for b in PLAIN_BANDS[:-1]] + [
    f"round_over_steady/{band_name(*b)}" for b in ROUND_BANDS[:-1]
]


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


def _each_step(engine: Engine, steps: list[tuple[int | None, int]]):
    return lambda: steps.append((engine.last_step.draft_steps, engine.last_step.end_ns))


def measure(draft: str, batch: int, args: argparse.Namespace) -> dict:
    """One engine's case: a warm-up run, then `args.repeats` timed runs."""
    engine = host_step.build(batch, draft, args.k, args.device)
    engine.spec.controller = AlternatingDraftSteps(args.rounds, args.plain, args.k)
    prompts = host_step.prompts(batch)
    timed_decode(engine, prompts, SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True))
    plain: dict[int, list[float]] = {}
    rounds: dict[int, list[float]] = {}
    sampling = SamplingParams(max_new_tokens=args.new, temperature=0.0, ignore_eos=True)
    for _ in range(args.repeats):
        steps: list[tuple[int | None, int]] = []
        timed_decode(engine, prompts, sampling, _each_step(engine, steps))
        p, r = places(steps)
        for into, got in ((plain, p), (rounds, r)):
            for place, times in got.items():
                into.setdefault(place, []).extend(times)
    engine.shutdown()
    plain_us, round_us = bands(plain, PLAIN_BANDS), bands(rounds, ROUND_BANDS)
    return {
        "plain_us": plain_us,
        "round_us": round_us,
        "plain_over_steady": over_steady(plain_us),
        "round_over_steady": over_steady(round_us),
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
    add_record_args(parser)
    args = parser.parse_args(argv)
    if not 1 <= args.new <= most:
        parser.error(f"--new: {args.new}, but a request holds 1 to {most} new tokens beside its prompt")
    logging.basicConfig(level=logging.WARNING)
    if args.device == "cpu":
        torch.set_num_threads(1)
    results = {}
    for draft in args.drafts.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            case = results[f"{draft}/b{batch}"] = measure(draft, batch, args)
            plain = " ".join(f"{b} {v:.2f}" for b, v in case["plain_over_steady"].items())
            rounds = " ".join(f"{b} {v:.2f}" for b, v in case["round_over_steady"].items())
            print(f"{draft}/b{batch}: plain steps after rounds {plain} | rounds after plain {rounds}", flush=True)
    write_out(args.out, results)
    record_run(args, "settle_steps", results, COLUMNS, device=args.device)


if __name__ == "__main__":
    main()
