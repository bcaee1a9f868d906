"""The first-token histograms count the same requests: after a mixed run on every door (gRPC, the
JSON-lines route, OpenAI completions and chat; successes, invalid requests, an aborted request, a
cancelled gRPC stream, HTTP streams the client closed after their first token), time to first
token, queue time and prefill time each grew by exactly the number of requests that received a
first token, however each ended."""

import json

import grpc
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from cluster.app import build_app
from cluster.client import GenerationClient
from cluster.proto.slidespec.v1 import generation_pb2 as pb
from ops import DEFAULT_MODEL

MODEL = "tiny-gemma3"
FIRST_TOKEN_HISTOGRAMS = (
    "slidespec_time_to_first_token_seconds_count",
    "slidespec_request_queue_time_seconds_count",
    "slidespec_request_prefill_time_seconds_count",
)
LONG = 1500  # tokens: a request that is still running when its client leaves
GREEDY = {"temperature": 0, "ignore_eos": True}  # OpenAI's routes: as many tokens as asked for


@pytest.fixture(scope="module")
def app(ray_serve):
    args = dict(model=DEFAULT_MODEL, page_size=16, max_total_tokens=8192, context_length=2048, grpc={"port": 0})
    handle = serve.run(build_app(args), name="counts", route_prefix="/counts")
    client = GenerationClient(f"127.0.0.1:{handle.ports.remote().result()['grpc']}")
    list(client.generate("def f(x):", max_new_tokens=2, temperature=0.0))  # the engine has compiled and run
    yield client, f"{ray_serve}/counts"
    client.close()


def _counts(base: str) -> dict[str, float]:
    r = requests.get(f"{base}/metrics", timeout=10)
    assert r.status_code == 200, r.text
    samples = {s.name: s.value for f in text_string_to_metric_families(r.text) for s in f.samples}
    return {name: samples.get(name, 0.0) for name in FIRST_TOKEN_HISTOGRAMS}


def _first_line_then_close(url: str, body: dict, sse: bool = False) -> None:
    """Read a streamed response up to its first token, then close the connection."""
    with requests.post(url, json=body, stream=True, timeout=60) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if not line:
                continue
            if sse:
                chunk = json.loads(line.removeprefix(b"data: "))
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    return
            elif json.loads(line)["token_ids"]:
                return
    raise AssertionError(f"{url}: the stream ended before its first token")


def test_first_token_histograms_count_every_request_that_got_a_first_token(app):
    client, base = app
    before = _counts(base)
    got_a_token = 0
    short = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}

    # successes: gRPC, the JSON-lines route streamed and whole, OpenAI completions (two prompts:
    # two requests) and a streamed chat
    assert client.complete("def f(x):", **short).usage.completion_tokens == 4
    lines = requests.post(f"{base}/generate", json={"prompt": "import os", "sampling": short}, timeout=60)
    assert lines.status_code == 200 and json.loads(lines.text.splitlines()[-1])["finished"]
    whole = requests.post(f"{base}/generate", json={"prompt": "x = 1", "sampling": short, "stream": False}, timeout=60)
    assert whole.status_code == 200 and whole.json()["usage"]["completion_tokens"] == 4
    completions = requests.post(
        f"{base}/v1/completions",
        json={"model": MODEL, "prompt": ["def g(y):", "class A:"], "max_tokens": 4, **GREEDY},
        timeout=60,
    )
    assert completions.status_code == 200 and len(completions.json()["choices"]) == 2, completions.text
    hi = [{"role": "user", "content": "hi"}]
    chat = requests.post(
        f"{base}/v1/chat/completions",
        json={"model": MODEL, "messages": hi, "max_tokens": 4, "stream": True, **GREEDY},
        timeout=60,
    )
    assert chat.status_code == 200 and chat.text.rstrip().endswith("data: [DONE]"), chat.text
    got_a_token += 6

    # invalid requests on every door: no token, counted by none of the three
    with pytest.raises(grpc.RpcError) as refused:
        client.complete("def f(x):", max_new_tokens=4, top_p=2.0)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    bad = requests.post(f"{base}/generate", json={"prompt": "x", "sampling": {"top_p": 2.0}}, timeout=60)
    assert bad.status_code == 400
    bad = requests.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": -1}, timeout=60)
    assert bad.status_code == 400

    # ended after their first token: aborted, cancelled by the gRPC client, closed by HTTP clients
    long = {"max_new_tokens": LONG, "temperature": 0.0, "ignore_eos": True}
    stream = client.generate("def f(x):", request_id="counted-abort", **long)
    assert next(stream).token_ids
    assert client.abort("counted-abort")
    assert list(stream)[-1].finish_reason == pb.FINISH_REASON_ABORT
    stream = client.generate("def h(z):", **long)
    assert next(stream).token_ids
    stream.cancel()
    _first_line_then_close(f"{base}/generate", {"prompt": "import sys", "sampling": long})
    _first_line_then_close(
        f"{base}/v1/chat/completions",
        {"model": MODEL, "messages": hi, "max_tokens": LONG, "stream": True, **GREEDY},
        sse=True,
    )
    got_a_token += 4

    after = _counts(base)
    grown = {name: after[name] - before[name] for name in FIRST_TOKEN_HISTOGRAMS}
    assert grown == dict.fromkeys(FIRST_TOKEN_HISTOGRAMS, float(got_a_token)), grown
