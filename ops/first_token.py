"""`slidespec first-token TRACES`: where each request's time to first token went.

Reads OTLP JSON-lines trace files (the `file` exporter's output) and joins each request span
(`gen_ai.response.id`, `gen_ai.server.time_to_first_token`) with the engine-step spans that
served it (`slidespec.request_ids`, in the same trace). The first token is sampled by the last
prefill (`EXTEND`) step of the request's leading run of them, so its time splits into

- in: from the request span's start (the front door) to its first engine step's start (routing,
  the hop to the replica's rank 0, waiting for a step);
- prefill: from there to the end of that last prefill step (the engine's own work);
- out: from that step's end to the moment the front door sent the first token (the hop back).

Steps run by an engine without a front door, and requests whose steps are not in the files, are
left out. The spans' wall clocks are compared: run the processes on one host (or synchronised).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from typing import Any

from ops.cli import run_command
from ops.diagnose import STEP_SPAN, load_spans

PREFILL_MODE = "EXTEND"


@dataclasses.dataclass(frozen=True)
class FirstToken:
    request_id: str
    in_ms: float
    prefill_ms: float
    out_ms: float

    @property
    def ttft_ms(self) -> float:
        return self.in_ms + self.prefill_ms + self.out_ms


def first_tokens(spans: list[dict[str, Any]]) -> list[FirstToken]:
    """One entry per request span whose first token and prefill steps are in `spans`."""
    steps: dict[str, list[dict[str, Any]]] = {}
    for s in spans:
        if s["name"] == STEP_SPAN:
            for rid in s["attrs"].get("slidespec.request_ids") or []:
                steps.setdefault(rid, []).append(s)
    out = []
    for s in spans:
        rid, ttft = s["attrs"].get("gen_ai.response.id"), s["attrs"].get("gen_ai.server.time_to_first_token")
        served = sorted(steps.get(rid, []), key=lambda step: step["start"])
        if ttft is None or not served or served[0]["attrs"].get("slidespec.forward_mode") != PREFILL_MODE:
            continue
        last = served[0]
        for step in served[1:]:
            if step["attrs"].get("slidespec.forward_mode") != PREFILL_MODE:
                break
            last = step
        sent = s["start"] + ttft * 1e9
        out.append(
            FirstToken(
                rid,
                (served[0]["start"] - s["start"]) / 1e6,
                (last["end"] - served[0]["start"]) / 1e6,
                (sent - last["end"]) / 1e6,
            )
        )
    return out


def report(entries: list[FirstToken]) -> str:
    if not entries:
        return "no request span with its first token and prefill steps in these traces"
    lines = [f"{len(entries)} requests; milliseconds", f"{'part':<10} {'median':>8} {'p90':>8} {'max':>8}"]
    for part in ("in_ms", "prefill_ms", "out_ms", "ttft_ms"):
        values = sorted(getattr(e, part) for e in entries)
        p90 = values[min(len(values) - 1, int(0.9 * len(values)))]
        lines.append(f"{part[:-3]:<10} {statistics.median(values):>8.2f} {p90:>8.2f} {values[-1]:>8.2f}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("traces", nargs="+", help="OTLP JSON-lines files or directories of them")


def run(args: argparse.Namespace) -> int:
    print(report(first_tokens(load_spans(args.traces))))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_command(run, parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
