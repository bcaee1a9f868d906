"""Chaos, bounded for CI: the soak scenario of `ops/bench/soak.py` (two replicas, mixed gRPC and
HTTP load with cancels, short deadlines and invalid requests; a rank actor and then the ingress
replica killed in each round), two rounds of 150 requests, up to 64 in flight. Every call ends
with a documented status within its bound (no hangs), requests are served again after each kill,
every replica is idle with its KV pools at their free counts afterwards, and the serving
processes' memory (this cluster's, on this host) does not grow from the first round to the
second beyond a stated bound."""

import json

import pytest
from ray import serve

from cluster.app import build_app
from cluster.client import GenerationClient
from ops.bench import soak
from tests.cluster.conftest import free_port

RSS_GROWTH_MB = 300  # between rounds, over every serving process (a replaced replica starts afresh)


@pytest.fixture(scope="module")
def app(ray_serve):
    port = free_port()
    serve.run(build_app(soak.app_args(port)), name="soak", route_prefix="/soak")
    client = GenerationClient(f"127.0.0.1:{port}")
    yield client, f"{ray_serve}/soak/generate"
    client.close()


def test_chaos_rounds_end_every_call_and_leak_nothing(app):
    client, route = app
    result = soak.soak(client, route, rounds=2, requests_per_round=150, concurrency=64, hang_s=60)
    print(json.dumps(result, indent=1))
    for r in result["rounds"]:
        assert r["hangs"] == 0 and not r["undefined"], r["by_code"]
        assert r["by_code"].get("OK", 0) + r["by_code"].get("200", 0) > 0, r["by_code"]
        assert r["by_code"].get("INVALID_ARGUMENT", 0) + r["by_code"].get("400", 0) > 0, r["by_code"]
        assert [f["recovery_s"] < 60 for f in r["faults"]] == [True, True], r["faults"]
        assert len(r["loads_after"]) == 2 and r["kv_used_after"] == 0, r["loads_after"]
    first, second = (r["serving_rss_mb"] for r in result["rounds"])
    assert first > 0, "no serving process of this cluster found"  # (another cluster's are not counted)
    assert second < first + RSS_GROWTH_MB, (first, second)
