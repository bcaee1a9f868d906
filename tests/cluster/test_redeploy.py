"""Zero-downtime redeploys: a changed configuration deployed under load replaces the ingress
and the engine replica, and every request in flight or arriving meanwhile, on both doors,
finishes: the old ingress stops taking calls but drains the ones it has, Serve drains the old
engine replica before it stops it, and the new ingress shares the gRPC port while both run."""

import threading
import time

import requests
from ray import serve

from cluster.app import build_app
from cluster.client import GenerationClient
from ops import DEFAULT_MODEL
from tests.cluster.conftest import free_port

SAMPLING = {"max_new_tokens": 48, "temperature": 0.0, "ignore_eos": True}


def _args(port: int, max_queued: int) -> dict:
    return dict(
        model=DEFAULT_MODEL,
        page_size=4,
        max_total_tokens=4096,
        context_length=512,
        num_replicas=1,
        max_queued_requests=max_queued,
        health_check_period_s=1,
        grpc={"port": port},
    )


def _replicas(client: GenerationClient) -> set[str]:
    return {load.replica for load in client.load().replicas}


def test_a_redeploy_under_load_fails_no_request(ray_serve):
    port = free_port()
    serve.run(build_app(_args(port, 64)), name="r", route_prefix="/r")
    client = GenerationClient(f"127.0.0.1:{port}")
    before = _replicas(client)
    outcomes: list[str] = []
    stop = threading.Event()

    def grpc_load(i: int) -> None:
        while not stop.is_set():
            try:
                last = list(client.generate([3, 4, i], timeout=60, **SAMPLING))[-1]
                outcomes.append("ok" if last.usage.completion_tokens == 48 else f"short {last}")
            except Exception as exc:  # noqa: BLE001 - every failure is counted, none expected
                outcomes.append(f"grpc {type(exc).__name__}: {exc}")

    def http_load(i: int) -> None:
        body = {"prompt_token_ids": [5, 6, i], "sampling": SAMPLING, "stream": False}
        while not stop.is_set():
            try:
                r = requests.post(f"{ray_serve}/r/generate", json=body, timeout=60)
                ok = r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 48
                outcomes.append("ok" if ok else f"http {r.status_code} {r.text[:200]}")
            except Exception as exc:  # noqa: BLE001
                outcomes.append(f"http {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=grpc_load, args=(i,)) for i in range(4)]
    threads += [threading.Thread(target=http_load, args=(i,)) for i in range(2)]
    deadline = time.monotonic() + 120

    def wait_for_answers(count: int) -> None:
        while len(outcomes) < count:
            assert time.monotonic() < deadline, f"{len(outcomes)} of {count} requests answered: {outcomes[:5]}"
            time.sleep(0.05)

    for t in threads:
        t.start()
    wait_for_answers(1)  # the load runs
    served_before = len(outcomes)
    serve.run(build_app(_args(port, 32)), name="r", route_prefix="/r")  # returns once the new replicas run
    wait_for_answers(served_before + 7)  # and goes on after it
    stop.set()
    for t in threads:
        t.join(timeout=90)
    after = _replicas(client)
    client.close()
    serve.delete("r")
    failures = [o for o in outcomes if o != "ok"]
    assert not failures, f"{len(failures)} of {len(outcomes)} failed: {failures[:5]}"
    assert served_before > 0 and len(outcomes) > served_before + 6
    assert after and not after & before, (before, after)  # the engine replica was replaced
