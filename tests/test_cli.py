"""The command line refuses bad input with one line naming it and status 2, not a traceback."""

import json

import pytest

from ops.cli import main


def _export(span: dict) -> str:
    return json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [span]}]}]})


BAD_TRACES = {
    "missing": (None, "cannot read"),
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
    if text is not None:
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
