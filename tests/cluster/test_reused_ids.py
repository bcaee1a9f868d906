"""A request id may be reused as soon as its request has ended. A request that ends must have let
go of everything kept under its id (the replica client's queue for it, an abort it owes rank 0)
before the gateway frees the id: a leftover of the old request found later under the same id
takes a new request's updates away (it then never ends) or aborts it. The gateway and the real
`RankClient` are driven without Ray; rank 0 is a fake link."""

import asyncio
import types

from cluster.gateway import Gateway, RequestFailed
from cluster.protocol import PromptLimits
from cluster.rank_actor import error_update
from cluster.rank_client import RankClient
from workers.rank_loop import ErrorCode


class FakeLink:
    """Rank 0: refuses the requests named in `refuse`, records submits and aborts, sends nothing
    by itself."""

    def __init__(self, refuse: set[str]) -> None:
        self.refuse = refuse
        self.log: list[tuple[str, str]] = []

    async def submit(self, rid, prompt_ids, sampling, trace_context, follows=None):
        self.log.append(("submit", rid))
        if rid in self.refuse:
            self.refuse.discard(rid)
            return error_update(ErrorCode.INVALID_ARGUMENT, "sampling.top_k: refused by rank 0")
        return None

    def abort(self, rid: str) -> None:
        self.log.append(("abort", rid))

    async def run(self, deliver) -> None:
        await asyncio.Event().wait()

    def close(self) -> None:
        pass


class OneReplica:
    """A replica set of one client (`Gateway(replicas=...)`)."""

    def __init__(self, client: RankClient) -> None:
        self.client = client

    async def acquire(self, request) -> RankClient:
        return self.client

    def release(self) -> None:
        pass

    def set_replica_aside(self, replica: str) -> None:
        pass


def _setup(refuse: set[str]) -> tuple[Gateway, RankClient, FakeLink]:
    link = FakeLink(refuse)
    client = RankClient(None, "r0", "ingress", None, 1, transport="socket")

    async def connect():
        return link

    client._connect = connect

    async def ready() -> bool:
        return True

    gateway = Gateway(None, "app", None, PromptLimits(64, 1), ready, 0, 0.0, replicas=OneReplica(client))
    return gateway, client, link


def _request(rid: str) -> dict:
    return {"request_id": rid, "prompt_token_ids": [1, 2, 3], "sampling": {"max_new_tokens": 1}, "stream": True}


TELEMETRY = types.SimpleNamespace(update=lambda update: None)


def test_a_refused_request_lets_go_of_its_id_before_a_new_request_takes_it():
    """Rank 0 refuses the first request "x"; a second "x" sent at once must get its own update."""

    async def run():
        gateway, client, link = _setup({"x"})
        try:
            _ = [u async for u in gateway.generate(_request("x"), TELEMETRY)]
        except RequestFailed as failed:
            assert failed.code == ErrorCode.INVALID_ARGUMENT.value
        else:
            raise AssertionError("the refused request streamed")
        second = gateway.generate(_request("x"), TELEMETRY)
        first_update = asyncio.ensure_future(second.__anext__())
        for _ in range(20):  # every task the first request left behind runs now
            await asyncio.sleep(0)
        assert "x" in client, "the second request's updates have nowhere to go"
        client._deliver({"updates": [{"request_id": "x", "token_ids": [9], "finished": True}]})
        update = await asyncio.wait_for(first_update, 5)
        assert update["token_ids"] == [9] and update["finished"]
        await second.aclose()
        assert len(client) == 0 and link.log == [("submit", "x"), ("submit", "x")]

    asyncio.run(run())


def test_a_request_closed_by_its_caller_aborts_before_its_id_is_free():
    """A caller that stops reading (a client gone) closes the stream: the abort of its request
    reaches rank 0 before the id is free, so it can never end a later request of that id."""

    async def run():
        gateway, client, link = _setup(set())
        stream = gateway.generate(_request("x"), TELEMETRY)
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.01)
        client._deliver({"updates": [{"request_id": "x", "token_ids": [4], "finished": False}]})
        assert (await asyncio.wait_for(first, 5))["token_ids"] == [4]
        await stream.aclose()
        assert link.log == [("submit", "x"), ("abort", "x")]  # before the id was free
        assert len(client) == 0

    asyncio.run(run())
