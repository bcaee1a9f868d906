"""The gateway retries a request on another replica only while its client has seen nothing:
an UNAVAILABLE before the first update is retried (up to `retries` times), one after it ends
the request (a retry would stream its tokens again). Driven without Ray."""

import asyncio
import types

import pytest

from cluster.gateway import Gateway, RequestFailed
from cluster.protocol import PromptLimits
from workers.rank_loop import ErrorCode


def _gateway(script: list[list]) -> tuple[Gateway, list[int]]:
    """A gateway whose attempts play `script`: each attempt yields its updates, then fails
    UNAVAILABLE if the list ends with "fail"."""

    async def ready() -> bool:
        return True

    gateway = Gateway(None, "app", None, PromptLimits(64, 1), ready, retries=2, retry_backoff_s=0.0)
    attempts = []

    async def attempt(routed):
        attempts.append(len(attempts))
        for step in script[len(attempts) - 1]:
            if step == "fail":
                raise RequestFailed(ErrorCode.UNAVAILABLE.value, "a replica failed")
            yield step

    gateway._attempt = attempt
    gateway._before_retry = lambda routed, message: None
    return gateway, attempts


def _run(gateway: Gateway) -> list[dict]:
    async def run():
        telemetry = types.SimpleNamespace(update=lambda update: None)
        return [u async for u in gateway.generate({"request_id": "r"}, telemetry)]

    return asyncio.run(run())


def test_a_failure_before_the_first_update_is_retried():
    done = {"token_ids": [7], "finished": True}
    gateway, attempts = _gateway([["fail"], ["fail"], [done]])
    assert _run(gateway) == [done] and attempts == [0, 1, 2]


def test_a_failure_after_the_first_update_ends_the_request():
    gateway, attempts = _gateway([[{"token_ids": [7], "finished": False}, "fail"], [{"token_ids": [7]}]])
    with pytest.raises(RequestFailed) as failed:
        _run(gateway)
    assert failed.value.code == ErrorCode.UNAVAILABLE.value and attempts == [0]
