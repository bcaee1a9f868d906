"""Requests a client can send at will must never take the service down or freeze a door: poison
sampling values, malformed and oversized bodies, duplicate and huge request ids, undecodable
gRPC messages. Each is answered at once with the right status naming the field, nothing is
retried that failed on its own content, other streams keep flowing, load and metrics stay live,
and bad input is logged without a traceback. One application, two replicas, both doors,
requests through the engine deployment's Serve handle (and its request router)."""

import json
import math
import os
import re
import threading
import time

import grpc
import pytest
import requests
from ray import serve

from cluster.app import build_app
from cluster.client import GenerationClient
from cluster.proto.slidespec.v1 import generation_pb2 as pb
from ops import DEFAULT_MODEL
from tests.cluster.conftest import session_logs

ARGS = dict(
    model=DEFAULT_MODEL,
    page_size=4,
    chunked_prefill_size=8,
    max_total_tokens=8192,
    context_length=4096,
    num_replicas=2,
    router={"policy": "round_robin"},
    health_check_period_s=1,
    grpc={"port": 0},
    ingress_path="serve_handle",  # the other applications take the direct path: both stay covered
)
GENERATE = "/slidespec.v1.Generation/Generate"


@pytest.fixture(scope="module")
def app(ray_serve):
    handle = serve.run(build_app(ARGS), name="h", route_prefix="/h")
    target = f"127.0.0.1:{handle.ports.remote().result()['grpc']}"
    client = GenerationClient(target)
    yield client, f"{ray_serve}/h/generate"
    client.close()


def _status(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        list(call())
    return info.value.code(), info.value.details()


def _replicas(client) -> list[str]:
    return sorted(load.replica for load in client.load().replicas)


def _tokens(client, prompt, **kwargs) -> list[int]:
    return [t for r in client.generate(prompt, **kwargs) for t in r.token_ids]


@pytest.mark.parametrize("temperature", [math.nan, 1e-38, 1e-45])
def test_a_poison_request_is_invalid_and_every_replica_keeps_serving(app, temperature):
    client, _ = app
    before = _replicas(client)
    code, details = _status(lambda: client.generate([1, 2, 3], temperature=temperature, max_new_tokens=4))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "sampling.temperature" in details
    served = [_tokens(client, [5, 6, i], max_new_tokens=3, temperature=0.0, ignore_eos=True) for i in range(10)]
    assert all(len(tokens) == 3 for tokens in served)
    assert _replicas(client) == before and len(before) == 2  # no replica died and was replaced


@pytest.mark.parametrize(
    "body, field",
    [
        ('{"prompt": "hi", "sampling": {"temperature": NaN}}', "sampling.temperature"),
        ('{"prompt": "hi", "sampling": {"temperature": 1e-45}}', "sampling.temperature"),
        ('{"prompt": "hi", "sampling": {"seed": 18446744073709551616}}', "sampling.seed"),
        ('{"prompt": "hi", "sampling": "greedy"}', "sampling"),
        ('{"prompt": "hi", "sampling": ["x"]}', "sampling"),
        ('{"prompt": "hi", "sampling": 5}', "sampling"),
        ('{"prompt": "hi", "sampling": {"max_new_tokens": "5"}}', "sampling.max_new_tokens"),
        ('{"prompt": "hi", "sampling": {"max_new_tokens": true}}', "sampling.max_new_tokens"),
        ('{"prompt": "hi", "sampling": {"temperature": "0.5"}}', "sampling.temperature"),
        ('{"prompt": "hi", "sampling": {"stop": "x"}}', "sampling.stop"),
        ('{"prompt_token_ids": "1,2"}', "prompt_token_ids"),
        ('{"prompt_token_ids": [1, "2"]}', "prompt_token_ids[1]"),
        ('{"prompt_token_ids": [1, true]}', "prompt_token_ids[1]"),
        ('{"prompt": 5}', "prompt"),
        ('{"prompt": "hi", "request_id": 7}', "request_id"),
        ('{"prompt": "hi", "colour": 1}', "colour"),
        ('{"prompt": "\\ud800"}', "prompt"),
        ('{"prompt": "hi", "session_id": "a\\udfff"}', "session_id"),
        ('{"prompt": "hi", "sampling": {"stop": ["\\ud800x"]}}', "sampling.stop[0]"),
        ('{"prompt": "hi", "prompt_token_ids": [1]}', "prompt / prompt_token_ids"),
        ("[1, 2]", "request"),
        ("not json", "request"),
    ],
)
def test_a_malformed_http_body_gets_400_naming_the_field_at_once(app, body, field):
    _, url = app
    r = requests.post(url, data=body, timeout=5)  # a hang fails here
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(field), r.text
    assert "Traceback" not in r.text


def test_http_bad_values_are_invalid_before_routing(app):
    _, url = app
    r = requests.post(url, json={"prompt_token_ids": [1, 2], "sampling": {"top_p": 0}}, timeout=5)
    assert r.status_code == 400 and "sampling.top_p" in r.json()["error"]["message"]
    r = requests.post(url, json={"prompt_token_ids": [1] * 4200}, timeout=5)
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"]


def test_a_duplicate_live_request_id_is_refused_on_both_doors(app):
    client, url = app
    first = client.generate([4, 4, 4], request_id="dup", max_new_tokens=120, temperature=0.0, ignore_eos=True)
    tokens = list(next(first).token_ids)
    code, details = _status(lambda: client.generate([1, 2], request_id="dup", max_new_tokens=2))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in details and "in use" in details
    r = requests.post(url, json={"request_id": "dup", "prompt_token_ids": [1, 2]}, timeout=5)
    assert r.status_code == 400 and "request_id" in r.json()["error"]["message"]
    for response in first:
        tokens += response.token_ids
    assert len(tokens) == 120 and response.finish_reason == pb.FINISH_REASON_LENGTH

    body = {"request_id": "dup2", "prompt_token_ids": [4, 4], "sampling": {"max_new_tokens": 120, "ignore_eos": True}}
    with requests.post(url, json=body, stream=True, timeout=30) as r:
        lines = r.iter_lines()
        next(lines)
        code, details = _status(lambda: client.generate([1, 2], request_id="dup2", max_new_tokens=2))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "in use" in details
        updates = [json.loads(line) for line in lines if line]
    assert updates[-1]["finish_reason"] == "FINISH_REASON_LENGTH" and "load" not in updates[-1]
    code, details = _status(lambda: client.generate([1, 2], request_id="x" * (1 << 20), max_new_tokens=2))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("request_id") and len(details) < 200


def test_undecodable_grpc_messages_are_invalid_argument(app):
    client, _ = app
    channel = client.channel
    call = channel.unary_stream(
        GENERATE, request_serializer=lambda raw: raw, response_deserializer=pb.GenerateResponse.FromString
    )
    for raw in (
        b"\xff\xff\xff\xff\xff\xff",
        os.urandom(64) + b"\x8f",
        b"\x12\x02\xff\xfe",
    ):  # the last: invalid UTF-8 prompt
        with pytest.raises(grpc.RpcError) as info:
            list(call(raw, timeout=5))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert "not a valid message" in info.value.details()
    abort = channel.unary_unary(
        "/slidespec.v1.Generation/Abort",
        request_serializer=lambda raw: raw,
        response_deserializer=pb.AbortResponse.FromString,
    )
    with pytest.raises(grpc.RpcError) as info:
        abort(b"\x0a\x02\xff\xfe", timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(_tokens(client, [1, 2, 3], max_new_tokens=2)) == 2  # still serving


def _wait_idle(client, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        loads = client.load().replicas
        if all((x.running, x.waiting, x.kv_full_used, x.kv_swa_used) == (0, 0, 0, 0) for x in loads) and loads:
            return loads
        assert time.monotonic() < deadline, loads
        time.sleep(0.1)


def _counts(url: str) -> dict[str, float]:
    """Requests by how they ended (`url`: the application's /generate route): successes by
    finish reason, failures by reason."""
    text = requests.get(url.removesuffix("/generate") + "/metrics", timeout=5).text
    counts = {}
    for m in re.finditer(r"^slidespec_request_(?:success|failure)_total\{(.*)\} (\S+)$", text, re.M):
        counts[re.search(r'reason="([^"]+)"', m.group(1)).group(1)] = float(m.group(2))
    return counts


def _deadline_passes_mid_stream(client) -> grpc.StatusCode:
    """A deadline that passes while the server streams: the first token proves the handler runs
    (a call that expires before the server takes it leaves nothing to count), and a short deadline
    keeps the server from finishing first (it would count a success while the client, still
    reading, hears DEADLINE_EXCEEDED). Tried again with a longer deadline when the first token
    came too late."""
    for timeout in (0.5, 1.0, 2.0, 4.0):
        stream = client.generate([9, 9, 7], max_new_tokens=4000, ignore_eos=True, timeout=timeout)
        try:
            next(stream)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
            continue
        with pytest.raises(grpc.RpcError) as info:
            list(stream)
        return info.value.code()
    pytest.fail("no first token within 4 s")


def test_load_is_live_and_every_ending_is_counted(app):
    client, url = app
    before = _counts(url)
    stream = client.generate([9, 9, 9], request_id="to-abort", max_new_tokens=300, temperature=0.0, ignore_eos=True)
    next(stream)
    assert client.load().replicas and any(x.running for x in client.load().replicas)
    assert client.abort("to-abort")
    last = list(stream)[-1]
    assert last.finish_reason == pb.FINISH_REASON_ABORT and last.usage.completion_tokens > 0 and last.replica
    _wait_idle(client)
    call = client.generate([9, 9, 8], max_new_tokens=500, temperature=0.0, ignore_eos=True)  # outlives the cancel
    next(call)
    call.cancel()
    assert _deadline_passes_mid_stream(client) == grpc.StatusCode.DEADLINE_EXCEEDED
    _status(lambda: client.generate([9], temperature=-1.0))
    _wait_idle(client)
    deadline = time.monotonic() + 15
    while True:
        after = _counts(url)
        grew = {
            reason: after.get(reason, 0) - before.get(reason, 0)
            for reason in ("abort", "cancelled", "deadline_exceeded", "invalid_argument")
        }
        if all(n >= 1 for n in grew.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert all(n >= 1 for n in grew.values()), grew


def test_oversized_inputs_are_answered_while_other_streams_flow(app):
    client, url = app
    gaps, done = [], threading.Event()

    def stream():
        last = time.monotonic()
        for _ in client.generate([3, 3, 3], max_new_tokens=400, temperature=0.0, ignore_eos=True):
            now = time.monotonic()
            gaps.append(now - last)
            last = now
        done.set()

    background = threading.Thread(target=stream)
    background.start()
    time.sleep(0.5)
    answers = {}
    start = time.monotonic()
    answers["grpc 12 MB prompt"] = _status(lambda: client.generate("a" * (12 << 20), max_new_tokens=4, timeout=10))
    answers["grpc 400 KB stop"] = _status(lambda: client.generate("hello", stop=["x" * 400_000], timeout=10))
    r = requests.post(url, data=b'{"prompt": "' + b"a" * (60 << 20) + b'"}', timeout=10)
    answers["http 60 MB body"] = (r.status_code, r.json()["error"]["message"])
    r = requests.post(url, json={"prompt": "a" * (12 << 20)}, timeout=10)
    answers["http 12 MB prompt"] = (r.status_code, r.json()["error"]["message"])
    r = requests.post(url, json={"prompt": "hello", "sampling": {"stop": ["x" * 400_000]}}, timeout=10)
    answers["http 400 KB stop"] = (r.status_code, r.json()["error"]["message"])
    elapsed = time.monotonic() - start
    background.join(60)
    assert done.is_set()
    assert (
        answers["grpc 12 MB prompt"][0] == grpc.StatusCode.INVALID_ARGUMENT
        and "prompt" in answers["grpc 12 MB prompt"][1]
    )
    assert (
        answers["grpc 400 KB stop"][0] == grpc.StatusCode.INVALID_ARGUMENT
        and "sampling.stop" in answers["grpc 400 KB stop"][1]
    )
    assert answers["http 60 MB body"][0] == 413
    assert answers["http 12 MB prompt"][0] == 400 and answers["http 12 MB prompt"][1].startswith("prompt")
    assert answers["http 400 KB stop"][0] == 400 and "sampling.stop" in answers["http 400 KB stop"][1]
    assert elapsed < 30, answers
    assert max(gaps) < 1.0, f"a stream stalled {max(gaps):.2f} s while oversized requests were answered"


def test_bad_input_is_logged_without_a_traceback(app):
    client, url = app
    for temperature in (math.nan, -1.0):
        _status(lambda t=temperature: client.generate([1, 2], temperature=t))
    requests.post(url, data='{"prompt": "hi", "sampling": 5}', timeout=5)
    requests.post(url, json={"prompt_token_ids": [1, 99999]}, timeout=5)  # found invalid by the engine
    time.sleep(1.0)
    for path, text in session_logs():
        for match in re.finditer(r"Traceback \(most recent call last\):(.*?)(?=\n\S|\Z)", text, re.S):
            tail = text[match.end() : match.end() + 400]
            assert not re.search(r"InvalidRequest|ValueError|vocabulary|sampling\.", tail), f"{path}: {tail}"
        for line in text.splitlines():
            if " ERROR " in line or line.startswith("ERROR"):
                assert not re.search(r"sampling\.|vocabulary|InvalidRequest", line), f"{path}: {line}"
