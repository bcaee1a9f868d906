"""Structured outputs through every door of a running application (the shipped tiny model with
its EAGLE draft, on loopback): the official `openai` client's `response_format` (json_schema
strict, json_object), vLLM's `structured_outputs` and `guided_*` parameters, tool calls forced
by `tool_choice` (required, a named function; streamed or not), `tool_choice: "auto"` with the
hermes parser (a text answer as `"none"` gives it; an output that a grammar makes a hermes call
comes back as that call), the JSON-lines route and gRPC; every output checked by `json.loads`,
the schema's own constraints or `re.fullmatch`. A schema
or regex that does not compile is a 400 / INVALID_ARGUMENT naming the parameter, and the replica's
KV pools are back to full free counts."""

import json
import re
import time

import grpc
import openai
import pytest
import requests

from cluster.client import build_request
from cluster.proto.slidespec.v1 import generation_pb2 as pb
from ops import DRAFT_MODELS
from tests.cluster.openai_app import deploy

TOKEN = "structured-test-token"
MODEL = "tiny-gemma3"
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "size": {"type": "integer", "maximum": 99}},
    "required": ["name", "size"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]},
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CHAT = [{"role": "user", "content": "def f(x):"}]


@pytest.fixture(scope="module")
def app(ray_serve, tmp_path_factory):
    yield from deploy(
        ray_serve,
        tmp_path_factory.mktemp("structured") / "token",
        TOKEN,
        "so",
        speculative={"algorithm": "eagle", "draft_model": DRAFT_MODELS["eagle"], "num_steps": 3},
        tool_call_parser="hermes",  # the shipped template shows no tool-call format of its own
    )


def _valid(text: str) -> dict:
    value = json.loads(text)
    assert set(value) == {"name", "size"} and isinstance(value["name"], str) and len(value["name"]) <= 8, value
    assert type(value["size"]) is int and value["size"] <= 99, value
    return value


def _idle(grpc_client, limit_s: float = 30.0) -> None:
    """Every replica's pools back to full free counts (the prefix cache flushed when idle)."""
    deadline = time.monotonic() + limit_s
    while True:
        loads = list(grpc_client.load().replicas)
        if all(x.running == 0 and x.kv_full_used == 0 and x.kv_swa_used == 0 for x in loads):
            return
        assert time.monotonic() < deadline, loads
        time.sleep(0.2)


def test_chat_response_format_json_schema_streamed_or_not(app):
    client, _, _ = app
    response_format = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    whole = client.chat.completions.create(
        model=MODEL, messages=CHAT, temperature=0.0, max_tokens=40, response_format=response_format
    )
    assert whole.choices[0].finish_reason == "stop"
    _valid(whole.choices[0].message.content)
    chunks = client.chat.completions.create(
        model=MODEL, messages=CHAT, temperature=0.0, max_tokens=40, response_format=response_format, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    sampled = client.chat.completions.create(
        model=MODEL, messages=CHAT, temperature=1.0, seed=3, max_tokens=40, response_format=response_format
    )
    _valid(sampled.choices[0].message.content)
    obj = client.chat.completions.create(
        model=MODEL, messages=CHAT, temperature=0.0, max_tokens=60, response_format={"type": "json_object"}
    )
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)


@pytest.mark.parametrize(
    "extra, check",
    [
        ({"guided_regex": r"[a-z]+\(x\)"}, lambda t: re.fullmatch(r"[a-z]+\(x\)", t)),
        ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
        ({"guided_json": SCHEMA}, _valid),
        ({"structured_outputs": {"grammar": 'root ::= "n = " [1-9] [0-9]?'}}, lambda t: re.fullmatch(r"n = \d+", t)),
        ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, _valid),
    ],
)
def test_completions_with_vllms_parameters(app, extra, check):
    client, _, _ = app
    out = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=40, temperature=0.0, extra_body=extra)
    assert out.choices[0].finish_reason == "stop" and check(out.choices[0].text), out.choices[0].text


def test_tool_choice_required_and_named_give_tool_calls(app):
    client, _, _ = app
    named = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        temperature=0.0,
        max_tokens=40,
        tools=[WEATHER, CLOCK],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    (call,) = named.choices[0].message.tool_calls
    assert named.choices[0].message.content is None and named.choices[0].finish_reason == "stop"
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    required = client.chat.completions.create(
        model=MODEL, messages=CHAT, temperature=0.0, max_tokens=60, tools=[WEATHER, CLOCK], tool_choice="required"
    )
    calls = required.choices[0].message.tool_calls
    assert required.choices[0].finish_reason == "tool_calls" and calls
    for call in calls:
        arguments = json.loads(call.function.arguments)
        assert call.function.name in ("get_weather", "get_time")
        assert arguments == {} if call.function.name == "get_time" else arguments["city"] in ("Paris", "Oslo")
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            temperature=0.0,
            max_tokens=40,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            stream=True,
        )
    )
    streamed = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert [(t.function.name, t.function.arguments) for t in streamed] == [
        (call.function.name, call.function.arguments) for call in named.choices[0].message.tool_calls
    ]
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)


def test_tool_choice_auto_answers_in_text_as_none_does(app):
    client, _, _ = app
    auto, none = (
        client.chat.completions.create(
            model=MODEL, messages=CHAT, temperature=0.0, max_tokens=16, tools=[WEATHER], tool_choice=choice
        ).choices[0]
        for choice in ("auto", "none")
    )
    assert auto.message.tool_calls is None and auto.message.content
    assert auto.message.content == none.message.content and auto.finish_reason == none.finish_reason


# what a Hermes-style model writes when it calls tools: text, then each call between tags
HERMES = (
    'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


def test_tool_choice_auto_parses_the_calls_out_of_the_text(app):
    """The output is made HERMES by a grammar (the tiny model was never taught to call tools);
    the server finds the calls in it, whole and streamed."""
    client, grpc_client, _ = app
    kwargs = dict(
        model=MODEL,
        messages=CHAT,
        temperature=0.0,
        max_tokens=120,
        tools=[WEATHER, CLOCK],
        tool_choice="auto",
        extra_body={"guided_choice": [HERMES]},
    )
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Checking."
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]
    assert calls == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert len({c.id for c in whole.message.tool_calls}) == 2
    chunks = [c.choices[0] for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    streamed = [t for c in chunks for t in c.delta.tool_calls or []]
    assert [(t.index, t.function.name, json.loads(t.function.arguments)) for t in streamed] == [
        (i, *call) for i, call in enumerate(calls)
    ]
    assert "".join(c.delta.content or "" for c in chunks) == "Checking."
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["tool_calls"]
    _idle(grpc_client)


def test_json_lines_route_and_grpc_take_structured_outputs(app):
    _, grpc_client, v1 = app
    body = {"prompt": "def f(x):", "stream": False, "sampling": {"temperature": 0.0, "max_new_tokens": 40}}
    body["sampling"]["structured_outputs"] = {"choice": ["alpha", "beta"]}
    route = f"{v1.removesuffix('/v1')}/generate"
    reply = requests.post(route, json=body, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["text"] in ("alpha", "beta")
    request = build_request("def f(x):", max_new_tokens=40, temperature=0.0)
    request.sampling.structured_outputs.json = json.dumps(SCHEMA)
    responses = list(grpc_client.stub.Generate(request, metadata=grpc_client.metadata))
    assert responses[-1].finish_reason == pb.FINISH_REASON_STOP
    _valid("".join(r.text for r in responses))


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}}, None),
        ({"extra_body": {"guided_regex": "[a-"}}, "guided_regex"),
        ({"extra_body": {"structured_outputs": {"json": "{oops"}}}, "structured_outputs"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"extra_body": {"guided_regex": "a", "guided_choice": ["a"]}}, "guided_regex"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ],
)
def test_bad_structured_outputs_get_400_naming_the_parameter_and_leave_no_kv(app, kwargs, param):
    client, grpc_client, _ = app
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, **kwargs)
    assert err.value.body["param"] == (param or "response_format"), err.value.body
    assert err.value.body["message"].startswith(f"{param or 'response_format'}: "), err.value.body
    _idle(grpc_client)


def test_grpc_refuses_a_regex_that_does_not_compile(app):
    _, grpc_client, _ = app
    request = build_request("def f(x):", max_new_tokens=8)
    request.sampling.structured_outputs.regex = "(unclosed"
    with pytest.raises(grpc.RpcError) as err:
        list(grpc_client.stub.Generate(request, metadata=grpc_client.metadata))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("structured_outputs.regex: cannot be compiled")
    _idle(grpc_client)
