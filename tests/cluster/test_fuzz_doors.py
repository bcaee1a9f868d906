"""Property-based fuzzing of the front doors against a live application.

Hypothesis generates request bodies field by field, each field either a value a client may send
or a hostile one (wrong type, out of range, NaN/inf, huge or empty, lone surrogates, unknown
fields, non-objects), and they are sent, eight at a time, through the real gRPC server and the
real HTTP route; gRPC also gets valid messages with raw bytes flipped or cut, HTTP bodies with
invalid UTF-8. Every answer must be a success that ends with a finish reason, or
INVALID_ARGUMENT (400, 413 for size) whose message starts with the offending field. The OpenAI
routes get completion and chat bodies built the same way and must answer a success or an
OpenAI-shaped 400/404 whose message starts with its parameter. Afterwards the application still
serves, nothing runs, and the replica's KV pools are back at their free counts; unknown gRPC
methods are UNIMPLEMENTED. A fixed seed, a pinned hypothesis (its examples differ between
versions, and with the project modules a run has imported: it mixes in their constants) and a
bounded number of cases (at least 2,000 per door) keep CI deterministic. Sent concurrently, the
cases found requests hanging when a refused request's id was reused at once
(`test_reused_ids.py`)."""

import json
import math
import os
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import cache

import grpc
import pytest
import requests
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from ray import serve

from cluster.app import build_app
from cluster.client import GenerationClient
from cluster.proto.slidespec.v1 import generation_pb2 as pb
from ops import DEFAULT_MODEL

CASES = 2000
IN_FLIGHT = 8
MODEL = os.path.basename(os.path.normpath(DEFAULT_MODEL))
CONTEXT = 256
VOCAB = json.load(open(os.path.join(DEFAULT_MODEL, "config.json")))["vocab_size"]
ARGS = dict(
    model=DEFAULT_MODEL,
    page_size=4,
    max_total_tokens=2048,
    context_length=CONTEXT,
    num_replicas=1,
    enable_prefix_caching=False,  # then "nothing held" is "every page free"
    max_request_bytes=64 << 10,
    grpc={"port": 0},
)
GENERATE = "/slidespec.v1.Generation/Generate"
FIELD = re.compile(r"^(request|prompt|prompt_token_ids|request_id|session_id|stream|sampling(\.\w+)?)\b")
FUZZ = settings(
    max_examples=CASES,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)


@pytest.fixture(scope="module")
def app(ray_serve):
    handle = serve.run(build_app(ARGS), name="fuzz", route_prefix="/fuzz")
    client = GenerationClient(f"127.0.0.1:{handle.ports.remote().result()['grpc']}")
    yield client, f"{ray_serve}/fuzz"
    client.close()


# -- values ---------------------------------------------------------------------------------------
HOSTILE_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from([0, -1, 2**31, 2**63, 2**64, -(2**63) - 1, 10**30]),
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 1e-45, 1e308, 0.5]),
    st.text(max_size=8),
    st.sampled_from(["", "\ud800", "\udfff\x00", "x" * 5000]),
)
HOSTILE = st.one_of(
    HOSTILE_SCALARS,
    st.lists(HOSTILE_SCALARS, max_size=3),
    st.dictionaries(st.text(max_size=4), HOSTILE_SCALARS, max_size=2),
)
TEXT = st.text(st.characters(codec="utf-8"), min_size=1, max_size=40)


@cache
def either(valid: st.SearchStrategy) -> st.SearchStrategy:
    """A field value: one a client may send or a hostile one (one strategy a field: hypothesis
    validates a new one at each draw)."""
    return st.one_of(valid, HOSTILE)


SAMPLING = {
    "temperature": st.one_of(st.just(0.0), st.floats(0.05, 2.0)),
    "top_p": st.floats(0.01, 1.0),
    "top_k": st.integers(-1, 50),
    "max_new_tokens": st.integers(1, 2),
    "seed": st.integers(0, 2**64 - 1),
    "ignore_eos": st.booleans(),
    "stop": st.lists(TEXT, max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 300), max_size=4),
    "min_p": st.floats(0.0, 1.0),
    "min_tokens": st.integers(0, 1),
    "frequency_penalty": st.floats(-2.0, 2.0),
    "presence_penalty": st.floats(-2.0, 2.0),
    "repetition_penalty": st.floats(0.5, 2.0),
    "logit_bias": st.dictionaries(st.integers(0, 300).map(str), st.floats(-100.0, 100.0), max_size=3),
    "logprobs": st.integers(0, 5),
    "prompt_logprobs": st.integers(0, 3),
    "n": st.integers(1, 2),
}
PROMPTS = {"prompt": TEXT, "prompt_token_ids": st.lists(st.integers(0, VOCAB + 20), min_size=1, max_size=20)}
ROUTING = {"request_id": st.text(min_size=1, max_size=12), "session_id": st.text(max_size=12), "stream": st.booleans()}
UNKNOWN = st.sampled_from(["extra", "sampling_params", "n", "0", "x" * 300])


def _shape(draw) -> tuple[bool, Callable[[st.SearchStrategy], object]] | None:
    """None for a body that is not an object (1 in 20); else whether every field is valid
    (about 1 in 4: these are served) and how a field's value is drawn (valid, or valid or
    hostile)."""
    shape = draw(st.integers(0, 19))
    if shape == 0:
        return None
    clean = shape <= 5
    return clean, lambda valid: draw(valid if clean else either(valid))


@st.composite
def bodies(draw) -> object:
    """A request body: not an object (1 in 20), every field valid (about 1 in 4: these are
    served), or fields each valid or hostile, one prompt field, both or neither, sometimes an
    unknown field."""
    shaped = _shape(draw)
    if shaped is None:
        return draw(HOSTILE)
    clean, value = shaped

    sampling = {k: value(v) for k, v in SAMPLING.items() if draw(st.booleans())}
    sampling.setdefault("max_new_tokens", 1)  # keep the valid requests short
    body = {k: value(v) for k, v in ROUTING.items() if draw(st.integers(0, 2)) == 0}
    given = [draw(st.sampled_from(sorted(PROMPTS)))]
    if not clean:
        given = draw(st.sampled_from([given, given, given, sorted(PROMPTS), []]))
    body.update({k: value(PROMPTS[k]) for k in given})
    body["sampling"] = sampling if clean or draw(st.integers(0, 3)) else draw(HOSTILE)
    if not clean and draw(st.integers(0, 9)) == 0:
        body[draw(UNKNOWN)] = draw(HOSTILE_SCALARS)
    return body


OPENAI_FIELDS = {
    "max_tokens": st.integers(1, 2),
    "temperature": st.one_of(st.just(0.0), st.floats(0.05, 2.0)),
    "top_p": st.floats(0.01, 1.0),
    "top_k": st.integers(-1, 50),
    "seed": st.integers(0, 2**63 - 1),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=3)),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "user": TEXT,
    "return_token_ids": st.booleans(),
    "logprobs": st.just(False),
    "n": st.integers(1, 2),
    "frequency_penalty": st.floats(-2.0, 2.0),
    "presence_penalty": st.floats(-2.0, 2.0),
    "repetition_penalty": st.floats(0.5, 2.0),
    "min_p": st.floats(0.0, 1.0),
    "min_tokens": st.integers(0, 1),
    "logit_bias": st.dictionaries(st.integers(0, 300).map(str), st.floats(-100.0, 100.0), max_size=3),
}
OPENAI_PARAMS = {*OPENAI_FIELDS, "model", "prompt", "messages", "best_of", "echo", "logit_bias", "tools", None}
IDS = st.lists(st.integers(0, VOCAB + 20), min_size=1, max_size=20)
OPENAI_PROMPT = st.one_of(TEXT, st.lists(TEXT, min_size=1, max_size=2), IDS, st.lists(IDS, min_size=1, max_size=2))
CONTENT = st.one_of(TEXT, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=2))
MESSAGES = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": CONTENT}),
    min_size=1,
    max_size=3,
)


@st.composite
def openai_bodies(draw, chat: bool) -> object:
    """A completion or chat body: not an object (1 in 20), every parameter valid (about 1 in 4),
    or parameters each valid or hostile, sometimes without the prompt or with the wrong model."""
    shaped = _shape(draw)
    if shaped is None:
        return draw(HOSTILE)
    clean, value = shaped

    body = {k: value(v) for k, v in OPENAI_FIELDS.items() if draw(st.integers(0, 2)) == 0}
    body["model"] = MODEL if clean or draw(st.integers(0, 9)) else draw(either(st.just("gpt-4")))
    if clean or draw(st.integers(0, 9)):
        body["messages" if chat else "prompt"] = value(MESSAGES if chat else OPENAI_PROMPT)
    body.setdefault("max_tokens", 1)  # keep the valid requests short
    if not clean and draw(st.integers(0, 9)) == 0:
        body[draw(st.sampled_from(["best_of", "echo", "logit_bias", "tools", "x" * 300]))] = draw(HOSTILE_SCALARS)
    return body


def _proto_value(field, value):
    """`value` where the proto field's type can carry it; None where it cannot."""
    kind = field.cpp_type
    if kind == field.CPPTYPE_FLOAT:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and not abs(value) > 3.4e38
    elif kind in (field.CPPTYPE_INT32, field.CPPTYPE_INT64, field.CPPTYPE_UINT64):
        bits = {field.CPPTYPE_INT32: 31, field.CPPTYPE_INT64: 63, field.CPPTYPE_UINT64: 64}[kind]
        low = 0 if kind == field.CPPTYPE_UINT64 else -(2**bits)
        ok = isinstance(value, int) and not isinstance(value, bool) and low <= value < 2**bits
    elif kind == field.CPPTYPE_BOOL:
        ok = isinstance(value, bool)
    else:
        ok = isinstance(value, str) and value == value.encode("utf-8", "ignore").decode("utf-8")
    return value if ok else None


def to_proto(body: object) -> pb.GenerateRequest:
    """The body as a gRPC message, keeping every value the message's types can carry (a body
    without max_new_tokens asks for one token)."""
    request = pb.GenerateRequest()
    if not isinstance(body, dict):
        return request
    for message, values in ((request, body), (request.sampling, body.get("sampling"))):
        if not isinstance(values, dict):
            continue
        for name, value in values.items():
            field = message.DESCRIPTOR.fields_by_name.get(name)
            if field is None or field.message_type is not None:
                continue
            if field.is_repeated:
                kept = [_proto_value(field, v) for v in value] if isinstance(value, list) else []
                getattr(message, name).extend(v for v in kept if v is not None)
            elif (kept := _proto_value(field, value)) is not None:
                setattr(message, name, kept)
    if not request.sampling.HasField("max_new_tokens"):  # not the default 128: keep the valid requests short
        request.sampling.max_new_tokens = 1
    return request


# -- checks ---------------------------------------------------------------------------------------
def check_invalid(message: str, where: str) -> None:
    """`field: what is wrong`, where the field is one of the request's or an unknown one."""
    field, _, what = message.partition(": ")
    assert what and (FIELD.match(field) or what == "unknown field"), f"{where}: no field named: {message!r}"
    assert len(message) < 600, f"{where}: the message echoes too much ({len(message)} characters)"


def grpc_outcome(call) -> str:
    try:
        responses = list(call())
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (exc.code(), exc.details())
        check_invalid(exc.details(), "gRPC")
        return "invalid"
    assert responses and responses[-1].finished and responses[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
    return "ok"


def http_outcome(route: str, data: bytes) -> str:
    r = requests.post(route, data=data, headers={"content-type": "application/json"}, timeout=60)
    if r.status_code != 200:
        assert r.status_code in (400, 413), (r.status_code, r.text[:300])
        error = r.json()["error"]
        assert error["code"] == ("RESOURCE_EXHAUSTED" if r.status_code == 413 else "INVALID_ARGUMENT")
        check_invalid(error["message"], "HTTP")
        return "invalid"
    lines = [json.loads(line) for line in r.content.split(b"\n") if line]  # NDJSON: only "\n" ends a line
    assert lines and "error" not in lines[-1] and lines[-1]["finished"], r.text[:300]
    return "ok"


def openai_outcome(url: str, data: bytes) -> str:
    r = requests.post(url, data=data, headers={"content-type": "application/json"}, timeout=60)
    if r.status_code != 200:
        assert r.status_code in (400, 404, 413), (r.status_code, r.text[:300])
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"], error
        assert error["param"] is None or error["message"].startswith(error["param"]), error
        assert error["param"] in OPENAI_PARAMS, f"OpenAI: a parameter no client sends: {error}"
        assert len(error["message"]) < 600, f"OpenAI: the message echoes too much ({len(error['message'])} characters)"
        return "invalid"
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [line.removeprefix("data: ") for line in r.text.split("\n\n") if line]
        assert events[-1] == "[DONE]", r.text[-300:]
        chunks = [json.loads(e) for e in events[:-1]]
        assert all("error" not in c for c in chunks), r.text[-300:]
        finished = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch.get("finish_reason")]
    else:
        finished = [ch["finish_reason"] for ch in r.json()["choices"]]
    assert finished and set(finished) <= {"stop", "length"}, r.text[-300:]
    return "ok"


def send_drawn(send: Callable[[object], str], strategy: st.SearchStrategy, fixed_seed: int) -> list[str]:
    """The outcome of each of `CASES` values of `strategy`, as hypothesis draws them under a fixed
    seed, sent `IN_FLIGHT` at a time (as clients send them) while the next ones are drawn; a
    failing case is named in the failure."""

    def one(case) -> str:
        try:
            return send(case)
        except Exception as e:  # an assertion, a timeout (a request that never ended): name the case
            raise AssertionError(f"{type(e).__name__}: {e}\ncase: {case!r:.2000}") from e

    with ThreadPoolExecutor(IN_FLIGHT) as pool:
        sent = []

        @seed(fixed_seed)
        @FUZZ
        @given(strategy)
        def submit(case):
            sent.append(pool.submit(one, case))

        submit()
        return [outcome.result() for outcome in sent]


def assert_run_held(client, outcomes: list[str]) -> None:
    """Every case ran, enough were served and enough refused, and the application is intact."""
    assert len(outcomes) >= CASES
    assert outcomes.count("ok") > CASES // 20 and outcomes.count("invalid") > CASES // 4, {
        o: outcomes.count(o) for o in set(outcomes)
    }
    assert_still_serving_and_idle(client)


def assert_still_serving_and_idle(client) -> None:
    tokens = [
        t for r in client.generate([5, 6, 7], max_new_tokens=3, temperature=0.0, ignore_eos=True) for t in r.token_ids
    ]
    assert len(tokens) == 3
    for load in client.load().replicas:
        assert load.running == 0 and load.waiting == 0, load
        assert load.kv_full_used == 0 and load.kv_swa_used == 0, f"KV held after every request ended: {load}"


# -- the doors ------------------------------------------------------------------------------------
def test_grpc_door(app):
    client, _ = app
    raw = client.channel.unary_stream(
        GENERATE, request_serializer=lambda b: b, response_deserializer=pb.GenerateResponse.FromString
    )
    mangles = st.one_of(st.none(), st.tuples(st.integers(0, 400), st.binary(min_size=1, max_size=4)))

    def send(case) -> str:
        body, mangle = case
        message = to_proto(body)
        if mangle is None:
            return grpc_outcome(lambda: client.stub.Generate(message, timeout=60))
        at, junk = mangle  # bytes flipped into (or cut from) a serialized message
        data = message.SerializeToString()
        data = data[: at % (len(data) + 1)] + junk + data[at % (len(data) + 1) + len(junk) :]
        try:
            pb.GenerateRequest.FromString(data)
        except Exception:  # not a message at all: the server must say so
            with pytest.raises(grpc.RpcError) as info:
                list(raw(data, timeout=60))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
            return "undecodable"
        return grpc_outcome(lambda: raw(data, timeout=60))

    assert_run_held(client, send_drawn(send, st.tuples(bodies(), mangles), 20261123))


def test_http_door(app):
    client, route = app

    def send(case) -> str:
        body, corrupt, at = case
        data = json.dumps(body).encode()
        if corrupt == 0:  # a byte that is not UTF-8
            at %= len(data) + 1
            data = data[:at] + b"\xff" + data[at:]
        elif corrupt == 1:  # over the size limit
            data = json.dumps({"prompt": "x" * (ARGS["max_request_bytes"] + 10)}).encode()
        return http_outcome(f"{route}/generate", data)

    cases = st.tuples(bodies(), st.integers(0, 15), st.integers(0, 10**6))
    assert_run_held(client, send_drawn(send, cases, 20261123))


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_openai_door(app, chat):
    client, route = app
    url = f"{route}/v1/{'chat/completions' if chat else 'completions'}"
    outcomes = send_drawn(lambda body: openai_outcome(url, json.dumps(body).encode()), openai_bodies(chat), 20261125)
    assert_run_held(client, outcomes)


def test_unknown_grpc_methods_are_unimplemented(app):
    client, _ = app
    for method in ("/slidespec.v1.Generation/Nope", "/slidespec.v1.Generation/generate", "/no.such.Service/Call"):
        call = client.channel.unary_unary(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as info:
            call(b"\x0a\x03abc\xff", timeout=10)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED, (method, info.value.details())
    assert_still_serving_and_idle(client)
