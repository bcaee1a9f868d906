"""How a benchmark records a run, so that every published figure is data with its provenance.

`ops/bench/results/` keeps, per benchmark:

- `<benchmark>-<machine>.json` and `.md`: the current record on that machine (`h200`, `h100`,
  `h200x2`, `cpu`): the date, the revision (git short hash of the tree measured), the exact
  command and the figures, the `.md` as a table;
- `<benchmark>.history.jsonl`: every recorded run on every machine, one JSON object a line,
  appended and never rewritten: date, revision, machine, command, figures, `kept` and, for an
  experiment that was measured and not merged (`kept: false`), `why`.

Figures are cases: `{case: {figure: value}}` (a shape and batch, a backend and concurrency, a
mode). A kept run replaces the cases it measured in the current record and leaves the others
there with the run that measured them (`earlier_runs`), so a benchmark run in parts (one
`--parts` or `--modes` at a time) keeps one record whose every case says where it comes from.

Benchmarks take `--record [DIR]` and `--not-kept WHY` through `add_record_args` and record
through `record_run`; `record` is the same for anything else (a GPU test run, a training run).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import subprocess
import sys
from typing import Any

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HISTORY_FIELDS = ("date", "revision", "machine", "command", "figures", "kept")
NAME = re.compile(r"[a-z0-9_]+")
MACHINE = re.compile(r"[a-z0-9]+")
REVISION_ENV = "SLIDESPEC_REVISION"


# -- where and what -------------------------------------------------------------------------------
def machine_name(device: str | None = None) -> str:
    """`cpu` for a CPU run (or a host without CUDA); else the GPU's model (`h200`, `h100`),
    with `x<count>` when this process sees several (`h200x2`)."""
    import torch

    if device == "cpu" or not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name(0)
    model = re.search(r"\b([A-Z]+[0-9]+[A-Z]*)\b", name)
    kind = model.group(1).lower() if model else re.sub(r"[^a-z0-9]", "", name.lower())
    count = torch.cuda.device_count()
    return f"{kind}x{count}" if count > 1 else kind


def revision() -> str:
    """The tree measured: `$SLIDESPEC_REVISION` where set (a copy of the tree without `.git`),
    else git's short hash, `-dirty` when tracked files differ from it."""
    if os.environ.get(REVISION_ENV):
        return os.environ[REVISION_ENV]
    try:
        done = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=7"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except OSError as e:
        raise RuntimeError(f"no revision: git failed ({e}); set {REVISION_ENV} to the tree's short hash") from e
    if done.returncode != 0:
        raise RuntimeError(
            f"no revision: {REPO_ROOT!r} is not a git checkout ({done.stderr.strip()}); "
            f"set {REVISION_ENV} to the tree's short hash"
        )
    return done.stdout.strip()


def _portable(arg: str) -> str:
    """An argument as a record shows it, shell-quoted: an absolute path becomes `<its name>` (a
    record is read on other machines, where a temporary directory means nothing)."""
    flag, eq, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
    if not os.path.isabs(value):
        return shlex.quote(arg)
    return f"{flag}{eq}<{os.path.basename(value.rstrip(os.sep)) or value}>"


def command_line(module: str, argv: list[str] | None = None) -> str:
    """The command that ran: `SLIDESPEC_*` settings of the environment, `python -m MODULE` and
    the arguments (`sys.argv[1:]` by default)."""
    env = [f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items()) if k.startswith("SLIDESPEC_")]
    env = [e for e in env if not e.startswith(f"{REVISION_ENV}=")]
    args = [_portable(a) for a in (sys.argv[1:] if argv is None else argv)]
    return " ".join([*env, "python", "-m", module, *args])


# -- the files ------------------------------------------------------------------------------------
def history_path(benchmark: str, results_dir: str = RESULTS_DIR) -> str:
    return os.path.join(results_dir, f"{benchmark}.history.jsonl")


def record_paths(benchmark: str, machine: str, results_dir: str = RESULTS_DIR) -> tuple[str, str]:
    """The current record's JSON and Markdown files."""
    stem = os.path.join(results_dir, f"{benchmark}-{machine}")
    return f"{stem}.json", f"{stem}.md"


def _tidy(value: Any) -> Any:
    """Floats to six significant digits: what a figure means, not the timer's noise."""
    if isinstance(value, float):
        return float(f"{value:.6g}")
    if isinstance(value, dict):
        return {str(k): _tidy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_tidy(v) for v in value]
    return value


def _one_line(field: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip() or "\n" in value:
        raise ValueError(f"{field}: {value!r}; a record needs it as one non-empty line")
    return value.strip()


def _check(benchmark: str, machine: str, figures: Any, kept: bool, why: str | None) -> None:
    if not NAME.fullmatch(benchmark):
        raise ValueError(f"benchmark: {benchmark!r}; allowed: lower-case letters, digits and _")
    if not MACHINE.fullmatch(machine):
        raise ValueError(f"machine: {machine!r}; allowed: lower-case letters and digits (h200, h200x2, cpu)")
    if not isinstance(figures, dict) or not figures:
        raise ValueError(f"figures: {figures!r}; allowed: a non-empty dict of cases, {{case: {{figure: value}}}}")
    for case, values in figures.items():
        if not isinstance(case, str) or not isinstance(values, dict):
            raise ValueError(f"figures[{case!r}]: {values!r}; allowed: a dict of figures under a string case")
    if kept and why is not None:
        raise ValueError(f"why: {why!r} given for a kept run; only a run not kept says why")
    if not kept:
        _one_line("why", why)


def record(
    benchmark: str,
    figures: dict[str, dict[str, Any]],
    command: str,
    columns: list[str] | None = None,
    machine: str | None = None,
    kept: bool = True,
    why: str | None = None,
    results_dir: str = RESULTS_DIR,
    date: str | None = None,
    rev: str | None = None,
    note: str | None = None,
) -> dict[str, Any]:
    """Append a run to `<benchmark>.history.jsonl` and, when kept, make it the current record of
    its cases in `<benchmark>-<machine>.json` / `.md`. Returns the history line.

    `columns`: the figures the `.md` table shows per case (a `a/b` path reaches into a nested
    figure; default: every number). `machine`, `date` and `rev` default to this host, today and
    the tree's revision; `note` is an optional line on what the run measured."""
    machine = machine or machine_name()
    _check(benchmark, machine, figures, kept, why)
    line: dict[str, Any] = {
        "date": date or datetime.date.today().isoformat(),
        "revision": rev or revision(),
        "machine": machine,
        "command": _one_line("command", command),
        "figures": _tidy(figures),
        "kept": kept,
    }
    if not kept:
        line["why"] = _one_line("why", why)
    if note is not None:
        line["note"] = _one_line("note", note)
    os.makedirs(results_dir, exist_ok=True)
    with open(history_path(benchmark, results_dir), "a") as f:
        f.write(json.dumps(line) + "\n")
    if kept:
        current = merge(read_current(benchmark, machine, results_dir), benchmark, line, columns)
        write_current(current, results_dir)
    return line


# -- the current record ---------------------------------------------------------------------------
def read_current(benchmark: str, machine: str, results_dir: str = RESULTS_DIR) -> dict[str, Any] | None:
    path = record_paths(benchmark, machine, results_dir)[0]
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _run_of(current: dict[str, Any], case: str) -> dict[str, str]:
    for run in current.get("earlier_runs", []):
        if case in run["cases"]:
            return {k: run[k] for k in ("date", "revision", "command")}
    return {k: current[k] for k in ("date", "revision", "command")}


def merge(
    current: dict[str, Any] | None, benchmark: str, line: dict[str, Any], columns: list[str] | None
) -> dict[str, Any]:
    """The current record after a kept run: its cases from the run, the cases it did not measure
    from the record before, each listed under the run that measured it."""
    new, before = line["figures"], (current or {}).get("figures", {})
    figures: dict[str, Any] = {}
    earlier: list[dict[str, Any]] = []
    for case, values in before.items():  # the record's order, with this run's cases in place
        figures[case] = new.get(case, values)
        if case in new:
            continue
        run = _run_of(current, case)
        group = next((g for g in earlier if all(g[k] == run[k] for k in run)), None)
        if group is None:
            group = {**run, "cases": []}
            earlier.append(group)
        group["cases"].append(case)
    figures.update((case, values) for case, values in new.items() if case not in figures)
    shown = list(columns or _numeric_figures(line["figures"]))
    shown += [c for c in (current or {}).get("columns", []) if c not in shown]
    out = {"benchmark": benchmark, "machine": line["machine"]}
    out.update({k: line[k] for k in ("date", "revision", "command")})
    out.update(columns=shown, figures=figures)
    if earlier:
        out["earlier_runs"] = earlier
    return out


def _numeric_figures(figures: dict[str, dict[str, Any]]) -> list[str]:
    names: list[str] = []
    for values in figures.values():
        names += [k for k, v in values.items() if isinstance(v, (int, float)) and k not in names]
    return names


def _lookup(values: dict[str, Any], path: str) -> Any:
    for part in path.split("/"):
        if not isinstance(values, dict) or part not in values:
            return None
        values = values[part]
    return values


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    if isinstance(value, list):
        return " / ".join(_cell(v) for v in value)
    if isinstance(value, dict):
        return json.dumps(value)
    return str(value).replace("|", "\\|")


def render_markdown(current: dict[str, Any]) -> str:
    """The `.md` of a current record: machine, date, revision, command, a table of the cases."""
    title = f"# {current['benchmark']} on {current['machine']}"
    lines = [title, ""]
    for label, key in (("Machine", "machine"), ("Date", "date"), ("Revision", "revision")):
        lines.append(f"- {label}: {current[key]}")
    lines.append(f"- Command: `{current['command']}`")
    earlier = current.get("earlier_runs", [])
    if earlier:
        lines.append("- Cases from earlier runs (the run above did not measure them):")
        for run in earlier:
            lines.append(f"  - {run['date']}, {run['revision']}, `{run['command']}`: {', '.join(run['cases'])}")
    columns = current["columns"]
    lines += ["", "| case | " + " | ".join(columns) + " |", "| --- " * (len(columns) + 1) + "|"]
    for case, values in current["figures"].items():
        lines.append(f"| {case} | " + " | ".join(_cell(_lookup(values, c)) for c in columns) + " |")
    return "\n".join(lines) + "\n"


def write_current(current: dict[str, Any], results_dir: str = RESULTS_DIR) -> None:
    json_path, md_path = record_paths(current["benchmark"], current["machine"], results_dir)
    with open(json_path, "w") as f:
        json.dump(current, f, indent=1)
        f.write("\n")
    with open(md_path, "w") as f:
        f.write(render_markdown(current))


# -- a benchmark's command line -------------------------------------------------------------------
class _RecordAction(argparse.Action):
    """Takes the revision and date when the option is parsed, so a tree that cannot say its
    revision fails before the measurement, not after it."""

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            namespace.record_revision = revision()
        except RuntimeError as e:
            parser.error(f"{option_string}: {e}")
        if self.dest == "not_kept" and (not values.strip() or "\n" in values):
            parser.error(f"{option_string}: {values!r}; say in one non-empty line why the experiment was not kept")
        namespace.record_date = datetime.date.today().isoformat()
        setattr(namespace, self.dest, self.const if values is None else values)


def write_out(path: str | None, data: Any) -> None:
    """A benchmark's `--out`: its cases as JSON at `path`, when one was given."""
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=1)


def add_record_args(parser: argparse.ArgumentParser) -> None:
    """`--record [DIR]` (write the run to DIR, by default `ops/bench/results/`) and
    `--not-kept WHY` (an experiment measured and not merged: history only)."""
    group = parser.add_argument_group("recording the run (ops/bench/record.py)")
    group.add_argument(
        "--record",
        nargs="?",
        const=RESULTS_DIR,
        action=_RecordAction,
        metavar="DIR",
        help="append the run to DIR/<benchmark>.history.jsonl and make it the current record "
        "DIR/<benchmark>-<machine>.json/.md (DIR: ops/bench/results/)",
    )
    group.add_argument(
        "--not-kept",
        metavar="WHY",
        action=_RecordAction,
        help="record the run as an experiment that was not merged, saying why in one line (history only)",
    )
    parser.set_defaults(record=None, not_kept=None, record_revision=None, record_date=None)


def record_run(
    args: argparse.Namespace,
    benchmark: str,
    figures: dict[str, dict[str, Any]],
    columns: list[str] | None = None,
    device: str | None = None,
    note: str | None = None,
) -> dict[str, Any] | None:
    """Record a benchmark's run as its `--record` / `--not-kept` ask; nothing without them.
    `device` is the run's (`cpu` records under the `cpu` machine on any host)."""
    if args.record is None and args.not_kept is None:
        return None
    return record(
        benchmark,
        figures,
        command_line(f"ops.bench.{benchmark}"),
        columns=columns,
        machine=machine_name(device),
        kept=args.not_kept is None,
        why=args.not_kept,
        results_dir=args.record or RESULTS_DIR,
        date=args.record_date,
        rev=args.record_revision,
        note=note,
    )
