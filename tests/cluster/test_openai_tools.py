"""Tool calls parsed out of a model's text (`tool_choice: "auto"`), against hand-written model
outputs in each format: several calls with text around them, malformed JSON and calls of tools the
request does not have (text, not calls), unterminated calls, and every way of streaming the same
text giving the whole text's content and calls. Which format a chat template asks for, and the
refusal of `auto` where it asks for none."""

import json
import random
from pathlib import Path
from typing import get_args

import pytest

from cluster.config import AppArgs
from cluster.openai_structured import Refused, structured_outputs
from cluster.openai_tools import TOOL_FORMATS, AutoTools, tool_format
from ops import DEFAULT_MODEL

NAMES = frozenset({"get_weather", "get_time"})
HERMES = AutoTools(TOOL_FORMATS["hermes"], NAMES)
LLAMA = AutoTools(TOOL_FORMATS["llama3_json"], NAMES)
WEATHER = ("get_weather", {"city": "Oslo"})
TIME = ("get_time", {})


def _hermes_call(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


MALFORMED = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"\n</tool_call>'
CASES = [
    # (tools, model output, content, calls)
    (HERMES, f"Let me check.\n{_hermes_call(*WEATHER)}\n{_hermes_call(*TIME)}", "Let me check.", [WEATHER, TIME]),
    (HERMES, f"{_hermes_call(*TIME)}\nDone, it is late.\n", "Done, it is late.", [TIME]),
    (HERMES, _hermes_call(*WEATHER)[: -len("\n</tool_call>")], None, [WEATHER]),  # ended before its tag
    (HERMES, f"{MALFORMED} then\n{_hermes_call(*TIME)}", f"{MALFORMED} then", [TIME]),
    (HERMES, f"{_hermes_call('rm_rf', {})} {_hermes_call(*TIME)}", _hermes_call("rm_rf", {}), [TIME]),  # no such tool
    (
        LLAMA,
        ' {"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}',
        None,
        [WEATHER, TIME],
    ),
    (LLAMA, '{"name": "get_time", "arguments": {}}', None, [TIME]),
]
# outputs that are text, unchanged: no call, or none that reads as one
AS_TEXT = [
    (HERMES, "def f(x):\n    return x  \n"),
    (HERMES, "a < b, and <tool_c"),
    (HERMES, f"{MALFORMED} then"),
    (HERMES, '<tool_call>{"name": "get_time", "arguments": "{}"}</tool_call>'),  # arguments not an object
    (HERMES, '<tool_call>{"name": "get_weather", "arguments": {"ci'),  # cut short
    (LLAMA, 'The call would be {"name": "get_time", "parameters": {}}'),
    (LLAMA, '{"name": "get_time", "parameters": {}} and more'),
    (LLAMA, '{"name": "get_weather", "parameters": {"city": "Os'),
]
OUTPUTS = CASES + [(tools, text, text, []) for tools, text in AS_TEXT]


def _calls(calls: list[dict]) -> list[tuple[str, dict]]:
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == len(calls)
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("tools, text, content, calls", OUTPUTS)
def test_a_whole_output_gives_its_content_and_calls(tools, text, content, calls):
    got_content, got_calls = tools.parse(text)
    assert (got_content or None, _calls(got_calls)) == (content, calls)


@pytest.mark.parametrize("tools, text, content, calls", OUTPUTS)
def test_every_streaming_of_an_output_gives_the_same(tools, text, content, calls):
    cuts = [list(range(1, len(text))), []] + [
        sorted(random.Random(seed).sample(range(1, len(text)), k=len(text) // 5)) for seed in range(8)
    ]
    for cut in cuts:
        parser, shown, made = tools.parser(), [], []
        for a, b in zip([0, *cut], [*cut, len(text)]):
            delta, new = parser.feed(text[a:b], final=b == len(text))
            shown.append(delta)
            made += new
        assert ("".join(shown) or None, _calls(made)) == (content, calls), cut


def test_a_call_is_sent_as_soon_as_it_is_complete():
    parser = HERMES.parser()
    assert parser.feed("Sure.\n<tool_") == ("Sure.", [])
    content, calls = parser.feed(_hermes_call(*WEATHER)[len("<tool_") :] + "\n<tool_call>")
    assert content == "" and _calls(calls) == [WEATHER]
    content, calls = parser.feed(_hermes_call(*TIME)[len("<tool_call>") :], final=True)
    assert content == "" and _calls(calls) == [TIME]


def test_the_format_is_the_settings_or_the_one_the_template_shows():
    qwen = '{%- if tools %}...<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>'
    llama = "{%- if builtin_tools is defined or tools is not none %}...<|python_tag|>..."
    gemma4 = "{%- macro format_tool_call(call) -%}<|tool_call>call:{{ call.name }}{...}<tool_call|>{%- endmacro -%}"
    assert tool_format("detect", qwen) is TOOL_FORMATS["hermes"]
    assert tool_format("detect", {"default": "plain", "tool_use": qwen}) is TOOL_FORMATS["hermes"]
    assert tool_format("detect", llama) is TOOL_FORMATS["llama3_json"]
    assert tool_format("detect", gemma4) is None  # its markers are special tokens, not in the text
    assert tool_format("detect", (Path(DEFAULT_MODEL) / "chat_template.jinja").read_text()) is None
    assert tool_format("detect", None) is None
    assert tool_format("none", qwen) is None and tool_format("hermes", None) is TOOL_FORMATS["hermes"]
    setting = AppArgs.model_fields["tool_call_parser"]
    assert set(get_args(setting.annotation)) == {"detect", "none", *TOOL_FORMATS}


def test_auto_is_parsed_where_there_is_a_format_and_refused_naming_the_field_where_not():
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    extra = {"tools": [weather], "tool_choice": "auto", "guided_choice": ["x"]}
    structured = structured_outputs(extra, chat=True, tool_format=TOOL_FORMATS["hermes"])
    assert structured.auto == AutoTools(TOOL_FORMATS["hermes"], frozenset({"get_weather"}))
    assert structured.template_tools == [weather] and structured.spec == {"choice": ["x"]}  # auto constrains nothing
    for choice in ("auto", None):
        with pytest.raises(Refused) as refused:
            structured_outputs({"tools": [weather], "tool_choice": choice}, chat=True, tool_format=None)
        assert refused.value.param == "tool_choice" and "chat template shows none" in str(refused.value)
    assert structured_outputs({"tools": [weather], "tool_choice": "none"}, chat=True).auto is None
