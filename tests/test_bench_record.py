"""Benchmark records: the writer (ops/bench/record.py) and the results folder it keeps."""

import argparse
import json
import os
import re

import pytest

from ops.bench import record as rec

RESULTS = rec.RESULTS_DIR
SESSIONS = re.compile(r"session ?[0-9]+|[0-9]+(st|nd|rd|th) session|sessions? [0-9]+-[0-9]+|\bsessions?\b", re.I)
MACHINE_PATHS = re.compile(r"(?<![\w.<])/(tmp|work|home|root)/")


def write(tmp_path, figures, **kw):
    kw = {"machine": "h200", "date": "2026-11-25", "rev": "abc1234", "results_dir": str(tmp_path), **kw}
    return rec.record("decode_step", figures, "python -m ops.bench.decode_step --shape gemma3-1b", **kw)


# -- the writer -----------------------------------------------------------------------------------
def test_a_kept_run_writes_the_record_and_a_history_line(tmp_path):
    line = write(tmp_path, {"gemma3-1b/b1": {"median_ms": 0.93456789123, "ms_per_step": [0.93, 0.94]}})
    json_path, md_path = rec.record_paths("decode_step", "h200", str(tmp_path))
    current = json.loads(open(json_path).read())
    assert current["figures"] == {"gemma3-1b/b1": {"median_ms": 0.934568, "ms_per_step": [0.93, 0.94]}}
    assert (current["date"], current["revision"], current["machine"]) == ("2026-11-25", "abc1234", "h200")
    assert current["columns"] == ["median_ms"] and "earlier_runs" not in current
    md = open(md_path).read()
    assert "- Revision: abc1234" in md and "| gemma3-1b/b1 | 0.9346 |" in md
    lines = open(rec.history_path("decode_step", str(tmp_path))).read().splitlines()
    assert [json.loads(x) for x in lines] == [line] and line["kept"] is True and "why" not in line


def test_history_is_appended_never_rewritten_and_cases_keep_their_run(tmp_path):
    write(tmp_path, {"a": {"x": 1.0}, "b": {"x": 2.0}})
    history = rec.history_path("decode_step", str(tmp_path))
    first = open(history).read()
    command = "python -m ops.bench.decode_step --tag two"
    rec.record(
        "decode_step",
        {"a": {"x": 3.0}},
        command,
        machine="h200",
        date="2026-11-26",
        rev="def5678",
        results_dir=str(tmp_path),
    )
    text = open(history).read()
    assert text.startswith(first) and len(text.splitlines()) == 2
    current = rec.read_current("decode_step", "h200", str(tmp_path))
    assert current["figures"] == {"a": {"x": 3.0}, "b": {"x": 2.0}}
    assert (current["revision"], current["command"]) == ("def5678", "python -m ops.bench.decode_step --tag two")
    assert current["earlier_runs"] == [
        {
            "date": "2026-11-25",
            "revision": "abc1234",
            "command": "python -m ops.bench.decode_step --shape gemma3-1b",
            "cases": ["b"],
        }
    ]
    assert (
        "abc1234, `python -m ops.bench.decode_step --shape gemma3-1b`: b"
        in open(rec.record_paths("decode_step", "h200", str(tmp_path))[1]).read()
    )


def test_a_run_not_kept_goes_to_history_only_and_says_why(tmp_path):
    write(tmp_path, {"a": {"x": 1.0}})
    before = rec.read_current("decode_step", "h200", str(tmp_path))
    line = write(tmp_path, {"a": {"x": 9.0}}, kept=False, why="slower: 1.06 against 1.03 ms a step")
    assert line["kept"] is False and line["why"].startswith("slower")
    assert rec.read_current("decode_step", "h200", str(tmp_path)) == before
    assert len(open(rec.history_path("decode_step", str(tmp_path))).read().splitlines()) == 2


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"kept": False}, "why"),
        ({"kept": False, "why": "two\nlines"}, "why"),
        ({"why": "kept runs say no why"}, "why"),
        ({"machine": "H200-x2"}, "machine"),
    ],
)
def test_bad_records_are_refused_naming_the_field(tmp_path, kw, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        write(tmp_path, {"a": {"x": 1.0}}, **kw)
    assert not os.listdir(tmp_path)


def test_figures_must_be_cases(tmp_path):
    with pytest.raises(ValueError, match="^figures"):
        write(tmp_path, {"x": 1.0})


def test_the_command_shows_settings_and_no_machine_paths(monkeypatch):
    monkeypatch.setenv("SLIDESPEC_PDL_EARLY", "0")
    monkeypatch.setenv("SLIDESPEC_REVISION", "abc1234")
    got = rec.command_line("ops.bench.serve_bench", ["--model", "/tmp/shapes-x1/llama3-8b", "--out=/tmp/r.json", "a b"])
    assert got == "SLIDESPEC_PDL_EARLY=0 python -m ops.bench.serve_bench --model <llama3-8b> --out=<r.json> 'a b'"


def test_machine_names(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert rec.machine_name() == "h100" and rec.machine_name("cpu") == "cpu"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert rec.machine_name("cuda") == "h200x2"


def parser():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=1)
    rec.add_record_args(p)
    return p


def test_the_shared_option_records_a_run(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIDESPEC_REVISION", "abc1234")
    monkeypatch.setattr("sys.argv", ["control_path.py", "--steps", "3", "--record", str(tmp_path)])
    args = parser().parse_args(["--steps", "3", "--record", str(tmp_path)])
    assert rec.record_run(args, "control_path", {"engine": {"steps_per_s": 1000.0}}, device="cpu")["kept"]
    current = rec.read_current("control_path", "cpu", str(tmp_path))
    assert current["command"] == f"python -m ops.bench.control_path --steps 3 --record <{tmp_path.name}>"
    args = parser().parse_args(["--not-kept", "an experiment", "--record", str(tmp_path)])
    assert rec.record_run(args, "control_path", {"engine": {"steps_per_s": 1.0}}, device="cpu")["why"]
    assert rec.record_run(parser().parse_args([]), "control_path", {"engine": {"steps_per_s": 1.0}}) is None
    assert len(open(rec.history_path("control_path", str(tmp_path))).read().splitlines()) == 2


def test_the_option_fails_before_the_run_without_a_revision_or_a_why(tmp_path, monkeypatch):
    monkeypatch.delenv("SLIDESPEC_REVISION", raising=False)
    monkeypatch.setattr(rec, "REPO_ROOT", str(tmp_path))  # not a git checkout
    with pytest.raises(SystemExit):
        parser().parse_args(["--record"])
    monkeypatch.setenv("SLIDESPEC_REVISION", "abc1234")
    with pytest.raises(SystemExit):
        parser().parse_args(["--not-kept", " "])


# -- the results folder ---------------------------------------------------------------------------
def results_files():
    return sorted(os.listdir(RESULTS))


def history(name):
    with open(os.path.join(RESULTS, name)) as f:
        return [json.loads(line) for line in f]


def test_the_folder_holds_records_and_histories_only():
    """A benchmark's files are its history and, per machine, one record (JSON and Markdown):
    no per-run files."""
    files = results_files()
    assert files
    for name in files:
        assert re.fullmatch(r"[a-z0-9_]+(\.history\.jsonl|-[a-z0-9]+\.(json|md))", name), name
        assert not SESSIONS.search(name), name
        if not name.endswith(".history.jsonl"):
            bench, rest = name.rsplit("-", 1)
            machine = rest.rsplit(".", 1)[0]
            assert {f"{bench}-{machine}.json", f"{bench}-{machine}.md", f"{bench}.history.jsonl"} <= set(files), name
    for name in (f for f in files if f.endswith(".json")):
        benchmark = name.rsplit("-", 1)[0]
        assert name[:-5] + ".md" in files and f"{benchmark}.history.jsonl" in files, name


def test_every_history_line_is_well_formed():
    for name in (f for f in results_files() if f.endswith(".history.jsonl")):
        lines = history(name)
        assert lines, name
        for i, line in enumerate(lines):
            where = f"{name}:{i + 1}"
            assert set(rec.HISTORY_FIELDS) <= set(line), where
            assert set(line) <= {*rec.HISTORY_FIELDS, "why", "note"}, where
            assert re.fullmatch(r"\d{4}-\d\d-\d\d", line["date"]), where
            assert re.fullmatch(r"[0-9a-f]{7,}(-dirty)?", line["revision"]), where
            assert rec.MACHINE.fullmatch(line["machine"]) and line["command"].strip(), where
            assert isinstance(line["figures"], dict) and line["figures"], where
            assert all(isinstance(v, dict) and v for v in line["figures"].values()), where
            assert line["kept"] in (True, False), where
            if line["kept"]:
                assert "why" not in line, where
            else:
                assert isinstance(line["why"], str) and line["why"].strip() and "\n" not in line["why"], where


def test_every_current_record_agrees_with_its_markdown_and_its_history():
    for name in (f for f in results_files() if f.endswith(".json")):
        with open(os.path.join(RESULTS, name)) as f:
            current = json.load(f)
        with open(os.path.join(RESULTS, name[:-5] + ".md")) as f:
            md = f.read()
        head = dict(re.findall(r"^- (Machine|Date|Revision|Command): (.*)$", md, re.M))
        assert head["Date"] == current["date"] and head["Revision"] == current["revision"], name
        assert head["Command"] == f"`{current['command']}`" and head["Machine"] == current["machine"], name
        assert md == rec.render_markdown(current), name
        assert name == f"{current['benchmark']}-{current['machine']}.json", name
        kept = [x for x in history(f"{current['benchmark']}.history.jsonl") if x["kept"]]
        for case, figures in current["figures"].items():
            run = rec._run_of(current, case)
            measured = [
                x["figures"][case]
                for x in kept
                if x["machine"] == current["machine"]
                and case in x["figures"]
                and all(x[k] == run[k] for k in ("date", "revision", "command"))
            ]
            assert figures in measured, f"{name}: {case} is in no kept history line of its run {run}"


def test_no_text_names_sessions_or_machine_paths():
    for name in results_files():
        with open(os.path.join(RESULTS, name)) as f:
            text = f.read()
        assert not SESSIONS.search(text), f"{name}: {SESSIONS.search(text).group(0)!r}"
        assert not MACHINE_PATHS.search(text), f"{name}: {MACHINE_PATHS.search(text).group(0)!r}"
