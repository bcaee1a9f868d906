"""`slidespec diagnose TRACES`: why did speculative decoding's accept length drop?

Reads OTLP JSON-lines trace files (the `file` exporter's output, or any OTLP JSON export),
takes the engine-step spans that verified drafts, and reports

- accept length over time, and by forward mode, attention backend, draft pool kind, algorithm,
  context length relative to the window, prefix-cache hit, batch size and request; acceptance by
  draft position;
- drops: the change point where the mean accept length falls most (a two-segment split tested
  like Welch's t), with the span attributes whose values changed there, and its cause: the
  drafts (acceptance fell at a draft position both sides drafted: the text, or the draft) or
  the draft-length controller (fewer draft steps a round, acceptance per position as before);
- decode steps by the draft steps they ran (0: plain decode steps, which verify nothing);
- a PNG plot of accept length per step with the change point marked.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import math
import os
import statistics
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Any

from ops.cli import read_file, run_command

STEP_SPAN = "engine step"
# Attributes compared across a drop: what configuration or state a step ran with.
DESCRIPTIVE = (
    "slidespec.draft.pool",
    "slidespec.attention.backend",
    "slidespec.attention.kernel",
    "slidespec.spec.algorithm",
    "slidespec.spec.num_steps",
    "slidespec.spec.draft_steps",
    "slidespec.forward_mode",
    "service.name",
    "slidespec.component",
)
MIN_SEGMENT = 5
MIN_T = 4.0
MIN_DROP = 0.5
MIN_RELATIVE_DROP = 0.15
# A draft position's acceptance fell across a drop when it fell by this much, tested like a
# two-proportion z test at this z.
MIN_RATE_DROP = 0.1
MIN_RATE_Z = 3.0


@dataclasses.dataclass
class StepPoint:
    start: int  # ns
    accept_lengths: list[int]
    attrs: dict[str, Any]

    @property
    def mean(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths)

    @property
    def draft_steps(self) -> int:
        """The drafts each of the step's requests verified (older traces: num_steps, always)."""
        return self.attrs.get("slidespec.spec.draft_steps", self.attrs.get("slidespec.spec.num_steps") or 0)


@dataclasses.dataclass
class Drop:
    index: int  # first step after the change
    before: float
    after: float
    t: float
    changed: list[tuple[str, Any, Any]]  # (attribute, dominant value before, after)
    cause: str = ""


def _value(v: dict[str, Any]) -> Any:
    """An OTLP JSON AnyValue as a Python value."""
    if "arrayValue" in v:
        return [_value(x) for x in v["arrayValue"].get("values", [])]
    for key in ("stringValue", "boolValue", "doubleValue"):
        if key in v:
            return v[key]
    if "intValue" in v:
        return int(v["intValue"])
    return None


def _attrs(items: Iterable[dict[str, Any]]) -> dict[str, Any]:
    return {a["key"]: _value(a.get("value", {})) for a in items}


def trace_files(paths: list[str]) -> list[str]:
    files = []
    for path in paths:
        files += (
            sorted(glob.glob(os.path.join(path, "*.jsonl")) + glob.glob(os.path.join(path, "*.json")))
            if os.path.isdir(path)
            else [path]
        )
    if not files:
        raise ValueError(f"TRACES: no trace files in {paths}")
    return files


def load_spans(paths: list[str]) -> list[dict[str, Any]]:
    """Every span in the files, with its resource attributes merged into its own. A file that
    cannot be read, or a line that is not an OTLP JSON export, is a ValueError naming it."""
    spans = []
    for path in trace_files(paths):
        for number, line in enumerate(read_file(path, "TRACES").split("\n"), 1):
            if not line.strip():
                continue
            try:
                spans += _line_spans(json.loads(line))
            except (ValueError, TypeError, KeyError, AttributeError) as exc:
                raise ValueError(
                    f"TRACES: {path}:{number} is not an OTLP JSON export line "
                    f"(an object of resourceSpans > scopeSpans > spans): {type(exc).__name__}: {exc}"
                ) from exc
    return spans


def _line_spans(export: dict[str, Any]) -> list[dict[str, Any]]:
    """The spans of one OTLP JSON export (one line of a JSON-lines file)."""
    spans = []
    for rs in export.get("resourceSpans", []):
        resource = _attrs(rs.get("resource", {}).get("attributes", []))
        for ss in rs.get("scopeSpans", []):
            for span in ss.get("spans", []):
                spans.append(
                    {
                        "name": span["name"],
                        "trace_id": span.get("traceId"),
                        "span_id": span.get("spanId"),
                        "parent": span.get("parentSpanId"),
                        "start": int(span.get("startTimeUnixNano", 0)),
                        "end": int(span.get("endTimeUnixNano", 0)),
                        "attrs": {**resource, **_attrs(span.get("attributes", []))},
                    }
                )
    return spans


def step_points(spans: list[dict[str, Any]]) -> list[StepPoint]:
    points = [
        StepPoint(s["start"], _accept_lengths(s), s["attrs"])
        for s in spans
        if s["name"] == STEP_SPAN and s["attrs"].get("slidespec.spec.accept_lengths")
    ]
    return sorted(points, key=lambda p: p.start)


def _accept_lengths(span: dict[str, Any]) -> list[int]:
    """A step span's accept lengths: a list of integers, as the engine records them."""
    lengths = span["attrs"]["slidespec.spec.accept_lengths"]
    if not isinstance(lengths, list) or not all(isinstance(n, int) and not isinstance(n, bool) for n in lengths):
        raise ValueError(
            f"TRACES: span {span['span_id']} of trace {span['trace_id']}: slidespec.spec.accept_lengths "
            f"must be a list of integers, got {lengths!r:.80}"
        )
    return lengths


def find_drop(points: list[StepPoint]) -> Drop | None:
    """The split of the step series with the largest significant fall in mean accept length."""
    values = [p.mean for p in points]
    best = None
    for i in range(MIN_SEGMENT, len(values) - MIN_SEGMENT + 1):
        a, b = values[:i], values[i:]
        ma, mb = statistics.fmean(a), statistics.fmean(b)
        drop = ma - mb
        if drop < MIN_DROP or drop < MIN_RELATIVE_DROP * ma:
            continue
        se = math.sqrt(statistics.pvariance(a) / len(a) + statistics.pvariance(b) / len(b))
        t = drop / se if se > 0 else math.inf
        if t >= MIN_T and (best is None or (t, drop) > (best.t, best.before - best.after)):
            best = Drop(i, ma, mb, t, [])
    if best is not None:
        best.changed = changed_attributes(points[: best.index], points[best.index :])
        best.cause = drop_cause(points[: best.index], points[best.index :])
    return best


def position_counts(points: list[StepPoint]) -> tuple[list[int], list[int]]:
    """Per draft position: the verify results that judged it (it was drafted and every draft
    before it accepted) and those that accepted it."""
    k = max((p.draft_steps for p in points), default=0)
    judged, accepted = [0] * k, [0] * k
    for p in points:
        for n in p.accept_lengths:
            for i in range(min(n, p.draft_steps)):
                judged[i] += 1
                accepted[i] += i < n - 1
    return judged, accepted


def drop_cause(before: list[StepPoint], after: list[StepPoint]) -> str:
    """Why accept length fell: acceptance fell at a draft position both sides drafted (the
    drafts met other text, or the draft changed), or the rounds drafted less (the controller
    chose fewer draft steps) with acceptance per position as before."""
    (jb, ab), (ja, aa) = position_counts(before), position_counts(after)
    fell = [
        (i, ab[i] / jb[i], aa[i] / ja[i])
        for i in range(min(len(jb), len(ja)))
        if jb[i] and ja[i] and _rate_fell(ab[i], jb[i], aa[i], ja[i])
    ]
    steps = [statistics.fmean(p.draft_steps for p in side) for side in (before, after)]
    if fell:
        rates = ", ".join(f"position {i + 1}: {b:.2f} -> {a:.2f}" for i, b, a in fell)
        return f"the drafts: acceptance fell ({rates}); the text, or the draft"
    if steps[1] < steps[0]:
        return (
            f"the draft-length controller: {steps[0]:.2f} -> {steps[1]:.2f} draft steps a round, "
            "acceptance per draft position as before"
        )
    return "neither acceptance per draft position nor the draft steps changed significantly"


def _rate_fell(accepted_a: int, judged_a: int, accepted_b: int, judged_b: int) -> bool:
    a, b = accepted_a / judged_a, accepted_b / judged_b
    pooled = (accepted_a + accepted_b) / (judged_a + judged_b)
    se = math.sqrt(pooled * (1 - pooled) * (1 / judged_a + 1 / judged_b))
    return a - b >= MIN_RATE_DROP and (se == 0 or (a - b) / se >= MIN_RATE_Z)


def draft_step_counts(spans: list[dict[str, Any]]) -> Counter:
    """Engine steps by the draft steps they ran, plain decode steps (0) included."""
    return Counter(
        s["attrs"]["slidespec.spec.draft_steps"]
        for s in spans
        if s["name"] == STEP_SPAN and "slidespec.spec.draft_steps" in s["attrs"]
    )


def _key(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def changed_attributes(before: list[StepPoint], after: list[StepPoint]) -> list[tuple[str, Any, Any]]:
    """Descriptive attributes whose most common value differs across the split."""
    changed = []
    keys = sorted({k for p in before + after for k in p.attrs if k in DESCRIPTIVE})
    for key in keys:
        a = Counter(_key(p.attrs.get(key)) for p in before).most_common(1)[0][0]
        b = Counter(_key(p.attrs.get(key)) for p in after).most_common(1)[0][0]
        if a != b:
            changed.append((key, a, b))
    return changed


def _context_bucket(ratio: float) -> str:
    for limit in (1, 2, 4, 8):
        if ratio < limit:
            return f"< {limit} windows"
    return ">= 8 windows"


def _hit_bucket(cached_tokens: int) -> str:
    if not cached_tokens:
        return "miss"
    for limit in (256, 1024, 4096):
        if cached_tokens < limit:
            return f"hit < {limit} tokens"
    return "hit >= 4096 tokens"


def breakdowns(points: list[StepPoint]) -> dict[str, dict[str, list[int]]]:
    """Accept lengths grouped by each dimension's value."""
    groups: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for p in points:
        a = p.attrs
        for dim, key in (
            ("forward mode", "slidespec.forward_mode"),
            ("backend", "slidespec.attention.backend"),
            ("draft pool", "slidespec.draft.pool"),
            ("algorithm", "slidespec.spec.algorithm"),
        ):
            groups[dim][str(a.get(key, "?"))] += p.accept_lengths
        groups["batch size"][str(len(p.accept_lengths))] += p.accept_lengths
        rids = a.get("slidespec.spec.request_ids") or []
        served = a.get("slidespec.request_ids") or []
        ratios = dict(zip(served, a.get("slidespec.seq_len_over_window") or []))
        hits = dict(zip(served, a.get("slidespec.cache.hit_tokens") or []))
        for rid, n in zip(rids, p.accept_lengths):
            groups["request"][rid] += [n]
            if rid in ratios:
                groups["context / window"][_context_bucket(ratios[rid])] += [n]
            if rid in hits:
                groups["prefix cache"][_hit_bucket(hits[rid])] += [n]
    return groups


def position_rates(points: list[StepPoint]) -> list[float]:
    """Share of verify steps whose draft at each position was accepted."""
    k = max((p.attrs.get("slidespec.spec.num_steps") or 0 for p in points), default=0)
    total = sum(len(p.accept_lengths) for p in points)
    return [sum(n - 1 > i for p in points for n in p.accept_lengths) / total for i in range(k)] if total else []


def report(points: list[StepPoint], drop: Drop | None, steps_by_drafts: Counter | None = None) -> str:
    lines = []
    lengths = [n for p in points for n in p.accept_lengths]
    lines.append(
        f"{len(lengths)} verify results in {len(points)} engine steps; mean accept length "
        f"{statistics.fmean(lengths):.2f}"
    )
    if steps_by_drafts:
        counts = ", ".join(f"{k}: {n}" for k, n in sorted(steps_by_drafts.items()))
        lines.append(f"decode steps by draft steps (0: plain): {counts}")
    for dim, groups in breakdowns(points).items():
        if dim == "request" and len(groups) > 20:
            continue
        lines.append(f"\nby {dim}:")
        lines.append(f"  {'value':<28} {'verify':>7} {'accept length':>14}")
        for value, ns in sorted(groups.items(), key=lambda kv: statistics.fmean(kv[1])):
            lines.append(f"  {value:<28} {len(ns):>7} {statistics.fmean(ns):>14.2f}")
    rates = position_rates(points)
    if rates:
        lines.append("\nacceptance by draft position: " + ", ".join(f"{i + 1}: {r:.2f}" for i, r in enumerate(rates)))
    if drop is None:
        lines.append("\nno accept-length drop detected")
    else:
        at = points[drop.index]
        lines.append(
            f"\nDROP at step {drop.index} of {len(points)} (t = {(at.start - points[0].start) / 1e9:.2f} s): "
            f"mean accept length {drop.before:.2f} -> {drop.after:.2f} (Welch t {drop.t:.1f})"
        )
        if drop.changed:
            lines.append("attributes that changed at the drop:")
            lines += [f"  {key}: {before} -> {after}" for key, before, after in drop.changed]
        else:
            lines.append("no step attribute changed at the drop (look at the requests' content)")
        lines.append(f"cause: {drop.cause}")
    return "\n".join(lines)


def plot(points: list[StepPoint], drop: Drop | None, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = points[0].start
    xs = [(p.start - t0) / 1e9 for p in points]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot(xs, [p.mean for p in points], ".", markersize=4, label="mean accept length per step")
    if drop is not None:
        x = xs[drop.index]
        ax.axvline(x, color="red", linestyle="--", label="drop")
        ax.hlines([drop.before, drop.after], [xs[0], x], [x, xs[-1]], colors="red")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("accept length")
    ax.set_title("speculative decoding accept length")
    ax.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def diagnose(paths: list[str], plot_path: str | None = None) -> tuple[str, Drop | None]:
    spans = load_spans(paths)
    points = step_points(spans)
    if not points:
        raise ValueError("TRACES: no engine-step spans with accept lengths (was speculative decoding on?)")
    drop = find_drop(points)
    if plot_path:
        plot(points, drop, plot_path)
    return report(points, drop, draft_step_counts(spans)), drop


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="slidespec diagnose", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_command(run, parser.parse_args(argv))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("traces", nargs="+", help="OTLP JSON-lines files or directories of them")
    parser.add_argument("--plot", default="accept_length.png", help="PNG to write ('' for none)")


def run(args: argparse.Namespace) -> int:
    text, _ = diagnose(args.traces, args.plot or None)
    print(text)
    if args.plot:
        print(f"\nplot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
