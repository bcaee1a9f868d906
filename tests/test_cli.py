"""The command lines (`slidespec`, `python -m ops.token_map`): what they write, and bad input
refused with one line naming it and status 2, not a traceback."""

import json

import pytest

from ops import token_map
from ops.cli import main


def _export(span: dict) -> str:
    return json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [span]}]}]})


BAD_TRACES = {
    "missing": (None, "cannot read"),
    "not UTF-8": (b'{"resourceSpans": []}\n\xff\n', "cannot read"),
    "not JSON": ("not json\n", ":1 is not an OTLP JSON export line"),
    "a list": ("[1, 2]\n", ":1 is not an OTLP JSON export line"),
    "resourceSpans a number": ('{"resourceSpans": 5}\n', ":1 is not an OTLP JSON export line"),
    "a span without a name": ("\n" + _export({"spanId": "a"}) + "\n", ":2 is not an OTLP JSON export line"),
    "a start time that is no number": (_export({"name": "x", "startTimeUnixNano": "soon"}), "is not an OTLP"),
    "accept lengths a string": (
        _export(
            {
                "name": "engine step",
                "attributes": [{"key": "slidespec.spec.accept_lengths", "value": {"stringValue": "abc"}}],
            }
        ),
        "accept_lengths must be a list of integers",
    ),
}


@pytest.mark.parametrize("command", ["diagnose", "first-token"])
@pytest.mark.parametrize("case", list(BAD_TRACES))
def test_trace_commands_name_the_file_and_line_they_cannot_read(tmp_path, capsys, command, case):
    text, expected = BAD_TRACES[case]
    path = tmp_path / "traces.jsonl"
    if isinstance(text, bytes):
        path.write_bytes(text)
    elif text is not None:
        path.write_text(text)
    if command == "first-token" and "accept lengths" in case:
        expected = None  # first-token does not read accept lengths: the file is valid for it
    status = main([command, str(path)])
    err = capsys.readouterr().err
    if expected is None:
        assert status == 0 and err == ""
        return
    assert status == 2, err
    assert err.startswith("error: TRACES: ") and expected in err and "Traceback" not in err
    assert str(path) in err or "span" in err


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["1,a", "--token-ids"], "prompt: --token-ids wants comma-separated integers, got '1,a'"),
        (
            ["hi", "--token-file", "/nonexistent/token"],
            "--token-file: cannot read /nonexistent/token: No such file or directory",
        ),
        (
            ["hi", "--tls-ca", "/nonexistent/ca.pem"],
            "--tls-ca: cannot read /nonexistent/ca.pem: No such file or directory",
        ),
    ],
)
def test_generate_names_the_option_it_cannot_use_before_connecting(capsys, argv, expected):
    assert main(["generate", *argv, "--target", "127.0.0.1:1", "--timeout", "1"]) == 2
    assert capsys.readouterr().err == f"error: {expected}\n"


def test_token_map_lists_the_most_frequent_ids_first_and_ties_by_id(tmp_path):
    from transformers import AutoTokenizer

    from ops import MODELS_DIR

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat; the cat ran. " * 3 + "a dog")
    out = tmp_path / "hot.json"
    assert token_map.main(["--model", "tiny-gemma3", "--size", "4", "--out", str(out), str(corpus)]) == 0
    ids = json.loads(out.read_text())
    tokenizer = AutoTokenizer.from_pretrained(f"{MODELS_DIR}/tiny-gemma3")
    encoded = tokenizer.encode(corpus.read_text(), add_special_tokens=False)
    counts = {t: encoded.count(t) for t in set(encoded)}
    assert len(ids) == 4 and len(set(ids)) == 4
    ranks = [(-counts[t], t) for t in ids]
    assert ranks == sorted(ranks)  # by count, ties to the lower id
    assert all((-c, t) > ranks[-1] for t, c in counts.items() if t not in ids)  # none left out ranks higher


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--size", "5", "/nonexistent/corpus.txt"], "error: files: cannot read /nonexistent/corpus.txt"),
        (["--size", "5", "--out", "/nonexistent/hot.json"], "error: --out: cannot write /nonexistent/hot.json"),
        (["--size", "0"], "argument --size: must be at least 1, got 0"),
        (["--size", "many"], "argument --size: invalid positive value: 'many'"),
    ],
)
def test_token_map_refuses_bad_input_naming_it(tmp_path, capsys, argv, expected):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text")
    argv = ["--model", "tiny-gemma3", *argv]
    if "--out" not in argv:
        argv += ["--out", str(tmp_path / "hot.json")]
    if not any(a.endswith(".txt") for a in argv):
        argv.append(str(corpus))
    try:
        status = token_map.main(argv)
    except SystemExit as exc:  # argparse's own refusals
        status = exc.code
    assert status == 2
    assert expected in capsys.readouterr().err
    assert not (tmp_path / "hot.json").exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--requests", "0"],
        ["demo", "--num-steps", "-1"],
        ["demo", "--replicas", "0"],
        ["demo", "--tp-size", "0"],
        ["demo", "--max-new-tokens", "0"],
        ["generate", "hi", "--max-new-tokens", "0"],
    ],
)
def test_counts_below_one_are_refused_before_anything_starts(capsys, argv):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert f"argument {argv[-2]}: must be at least 1, got {argv[-1]}" in capsys.readouterr().err


def test_demo_refuses_a_draft_its_model_set_does_not_ship_before_anything_starts(capsys):
    assert main(["demo", "--models", "gemma4", "--algorithm", "eagle"]) == 2
    assert capsys.readouterr().err == "error: --algorithm: 'eagle' has no shipped gemma4 draft; choose from ['mtp']\n"
