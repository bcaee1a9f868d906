"""A stream whose reader left is counted as cancelled (or deadline_exceeded), never as an error,
however the server stops the handler: by cancelling its task while it waits for the engine, or
by closing its generator at a `yield` (gRPC does this when the cancellation meets a write in
progress; a client that left the HTTP stream likewise). The doors' handlers run here against a
gateway that streams without end, with the real metrics and request telemetry."""

import asyncio

import pytest

from cluster.grpc_server import GenerationService
from cluster.http_api import HttpApi
from cluster.metrics import ServingMetrics
from cluster.proto.slidespec.v1 import generation_pb2 as pb
from cluster.telemetry import RequestTelemetry

MODEL = "m"


class EndlessGateway:
    """Prepares any request and streams one token at a time until it is stopped."""

    async def prepare(self, body, door):
        return {"request_id": "r", "prompt_token_ids": [1, 2], "stream": True}

    async def generate(self, body, telemetry):
        while True:
            await asyncio.sleep(0.001)
            update = {"request_id": "r", "token_ids": [7], "finished": False}
            telemetry.update(update)
            yield update


class Context:
    """The parts of a gRPC servicer context the handler reads."""

    def __init__(self, remaining: float | None) -> None:
        self.remaining = remaining
        self.gone = False

    def cancelled(self) -> bool:
        return self.gone

    def time_remaining(self) -> float | None:
        return self.remaining

    def invocation_metadata(self):
        return ()


def _failures(metrics: ServingMetrics) -> dict[str, float]:
    counts = {}
    for metric in metrics.registry.collect():
        for sample in metric.samples:
            if sample.name == "slidespec_request_failure_total":
                counts[sample.labels["reason"]] = sample.value
    return counts


def _service(metrics: ServingMetrics) -> GenerationService:
    async def nothing():
        return None

    return GenerationService(
        EndlessGateway(),
        nothing,
        nothing,
        nothing,
        lambda body, metadata, server: RequestTelemetry(None, metrics, MODEL, body, metadata, server),
    )


@pytest.mark.parametrize(("remaining", "reason"), [(None, "cancelled"), (0.1, "deadline_exceeded")])
def test_grpc_generator_closed_at_a_write(remaining, reason):
    async def run():
        metrics, context = ServingMetrics(MODEL), Context(remaining)
        stream = _service(metrics).Generate(pb.GenerateRequest(prompt_token_ids=[1, 2]), context)
        assert list((await stream.__anext__()).token_ids) == [7]
        context.gone = True
        await stream.aclose()  # GeneratorExit at the handler's yield
        return _failures(metrics)

    assert asyncio.run(run()) == {reason: 1.0}


def test_grpc_task_cancelled_while_waiting():
    async def run():
        metrics, context = ServingMetrics(MODEL), Context(None)
        stream = _service(metrics).Generate(pb.GenerateRequest(prompt_token_ids=[1, 2]), context)

        async def read():
            async for _ in stream:
                pass

        task = asyncio.create_task(read())
        await asyncio.sleep(0.05)
        context.gone = True
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return _failures(metrics)

    assert asyncio.run(run()) == {"cancelled": 1.0}


def test_http_stream_closed_by_a_client_that_left():
    async def run():
        metrics = ServingMetrics(MODEL)
        body = {"request_id": "r", "prompt_token_ids": [1, 2]}
        telemetry = RequestTelemetry(None, metrics, MODEL, body, {})
        updates = EndlessGateway().generate(body, telemetry)
        first = await updates.__anext__()
        lines = HttpApi._lines(first, updates, telemetry)
        await lines.__anext__()
        await lines.__anext__()
        await lines.aclose()
        return _failures(metrics)

    assert asyncio.run(run()) == {"cancelled": 1.0}
