"""The Serve deployment on a local Ray cluster: a replica of two rank actors (gloo) generates the
in-process engine's greedy tokens with and without speculative decoding and leaves every rank's
KV pools full; HTTP streaming and bad input; killing a rank actor fails the request in flight,
fails the health check and Serve replaces the replica."""

import asyncio
import json
import time

import pytest
import ray
import requests
from pydantic import ValidationError
from ray import serve

from cluster.app import build_app
from cluster.config import AppArgs
from cluster.rank_actor import rank_actor_name
from tests.draft_models import make_target_and_draft
from tests.hf_models import random_prompts
from workers.engine import Engine, SamplingParams

NEW = 20
PROMPTS = random_prompts([29, 11, 17, 40])
STALL_S = 8  # a tiny model's step on CPU takes milliseconds; room for one starved on a loaded 2-core host
# (with 4 s, the ranks were once killed before the test had installed its stall)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_target_and_draft(tmp_path_factory.mktemp("serve"), noise=0.1)


def _args(target: str, **extra) -> dict:
    return dict(
        model=target,
        tp_size=2,
        page_size=4,
        chunked_prefill_size=8,
        max_total_tokens=2048,
        context_length=1024,
        health_check_period_s=1,
        health_check_timeout_s=5,
        stall_timeout_s=STALL_S,
        **extra,
    )


@pytest.fixture(scope="module")
def apps(ray_serve, models):
    """Engine deployment handles of two applications (the ingress in front is not used here)."""
    target, draft = models
    spec = {"algorithm": "standalone", "draft_model": draft, "num_steps": 3, "adaptive": False}
    for name, extra in (("plain", {}), ("spec", {"speculative": spec})):
        serve.run(build_app(_args(target, grpc={"port": 0}, **extra)), name=name, route_prefix=f"/{name}")
    return {name: serve.get_deployment_handle("LLMServer", app_name=name) for name in ("plain", "spec")}


async def _generate(handle, prompt, max_new=NEW):
    tokens, last = [], None
    body = {"prompt_token_ids": prompt, "sampling": {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True}}
    async for update in handle.options(stream=True).generate.remote(body):
        tokens += update["token_ids"]
        last = update
    return tokens, last


@pytest.mark.parametrize("app", ["plain", "spec"])
def test_tp2_replica_matches_the_in_process_engine(apps, models, app):
    target, draft = models
    spec = {"algorithm": "standalone", "draft_model": draft, "num_steps": 3, "adaptive": False}
    spec = spec if app == "spec" else None
    ref = Engine(
        model=target, page_size=4, chunked_prefill_size=8, max_total_tokens=2048, context_length=1024, speculative=spec
    ).generate(prompt_token_ids=PROMPTS, sampling=SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True))

    async def all_prompts():
        return await asyncio.gather(*[_generate(apps[app], p) for p in PROMPTS])

    got = asyncio.run(all_prompts())
    assert [tokens for tokens, _ in got] == [o.token_ids for o in ref]
    for (_, last), o in zip(got, ref):
        assert last["finish_reason"] == "length" and last["completion_tokens"] == NEW
        if spec:
            assert last["spec"]["accept_lengths"] == o.spec.accept_lengths
    ranks = apps[app].kv_check.remote().result()
    assert len(ranks) == 2 and all(r["full_free"] == r["full_total"] and r["swa_free"] == r["swa_total"] for r in ranks)
    info = apps[app].model_info.remote().result()
    assert info["tp_size"] == 2 and info["speculative"] == ("standalone" if spec else None)


def test_http_stream_and_bad_input(apps, ray_serve):
    body = {"prompt_token_ids": PROMPTS[0], "sampling": {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}}
    with requests.post(f"{ray_serve}/plain/generate", json=body, stream=True, timeout=60) as r:
        assert r.status_code == 200
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert sum(len(u["token_ids"]) for u in lines) == 5 and lines[-1]["finished"]
    for bad, field in [
        ({"prompt_token_ids": []}, "prompt_token_ids"),
        ({"prompt_token_ids": [1], "sampling": {"temperature": -1}}, "temperature"),
        ({"prompt_token_ids": [1], "sampling": {"colour": 1}}, "colour"),
        ({"prompt_token_ids": [1, 99999]}, "vocabulary"),
        ({"prompt_token_ids": [1] * 1024}, "context length"),
        ({"prompt_token_ids": [1], "sampling": {"stop": [""]}}, "sampling.stop"),
    ]:
        r = requests.post(f"{ray_serve}/plain/generate", json=bad, timeout=60)
        error = r.json()["error"]
        assert r.status_code == 400 and error["code"] == "INVALID_ARGUMENT" and field in error["message"], r.text
        assert "Traceback" not in r.text
    ranks = apps["plain"].kv_check.remote().result()
    assert all(r["full_free"] == r["full_total"] for r in ranks)


def test_bad_app_args_name_the_field(models):
    with pytest.raises(ValidationError, match="tp_size"):
        AppArgs(model=models[0], tp_size=0)
    with pytest.raises(ValidationError, match="model"):
        AppArgs(model="no/such/model")
    with pytest.raises(ValidationError, match="placement_strategy"):
        AppArgs(model=models[0], placement_strategy="ANYWHERE")
    # the ingress checks prompts against the context length build_app resolves: nothing deploys
    with pytest.raises(ValueError, match="context_length: 1000000 is longer than the model's"):
        build_app({"model": models[0], "context_length": 10**6})


def test_killed_rank_fails_in_flight_request_and_serve_replaces_the_replica(apps):
    handle = apps["plain"]
    before = handle.model_info.remote().result()["replica"]

    async def in_flight():
        body = {
            "prompt_token_ids": [1, 2, 3],
            "sampling": {"max_new_tokens": 900, "temperature": 0.0, "ignore_eos": True},
        }
        seen, killed = 0, False
        async for update in handle.options(stream=True).generate.remote(body):
            seen += len(update["token_ids"])
            if seen >= 5 and not killed:
                ray.kill(ray.get_actor(rank_actor_name("plain", before, 1)))
                killed = True
        return update

    last = asyncio.run(asyncio.wait_for(in_flight(), timeout=60))  # an error, within the timeout: no hang
    assert last["finished"] and last["error"]["code"] == "unavailable", last
    _replaced_and_serving(handle, before)


def _replaced_and_serving(handle, before: str) -> None:
    """Serve replaced replica `before` within 90 s, and the new one serves."""
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            if handle.model_info.remote().result(timeout_s=10)["replica"] != before:
                break
        except Exception:  # noqa: BLE001 - the old replica is going away
            pass
        time.sleep(1)
    else:
        pytest.fail(f"Serve did not replace replica {before}")
    tokens, last = asyncio.run(_generate(handle, PROMPTS[1], max_new=4))
    assert len(tokens) == 4 and last["finished"]


def _stall(actor) -> None:
    """Run inside rank 0: its next engine step never returns (a hung kernel or collective)."""
    actor.loop.engine.step = lambda: time.sleep(3600)


def test_a_stalled_engine_loop_fails_its_requests_and_is_replaced(apps):
    handle = apps["spec"]
    before = handle.model_info.remote().result()["replica"]

    async def in_flight():
        body = {"prompt_token_ids": [4, 5, 6], "sampling": {"max_new_tokens": 900, "temperature": 0.0}}
        seen, stalled_at = 0, None
        async for update in handle.options(stream=True).generate.remote(body):
            seen += len(update["token_ids"])
            if seen >= 5 and stalled_at is None:
                ray.get(ray.get_actor(rank_actor_name("spec", before, 0)).__ray_call__.remote(_stall))
                stalled_at = time.monotonic()
        return update, time.monotonic() - stalled_at

    last, waited = asyncio.run(asyncio.wait_for(in_flight(), timeout=60))
    assert last["finished"] and last["error"]["code"] == "unavailable", last
    assert waited < STALL_S + 1 + 5, f"the stalled request ended after {waited:.1f} s"  # watchdog + a health period
    _replaced_and_serving(handle, before)
