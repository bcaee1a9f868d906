"""The ingress's admission on its direct path to replicas, as Serve's handle admits: at most
`max_ongoing_requests` on a replica, at most `max_queued_requests` waiting for one (then the
queue is full), a waiting request goes when one ends; a replica set aside (draining, failing)
is not chosen; a retry avoids the replica that failed it. Driven without Ray."""

import asyncio

import pytest

from cluster.rank_client import RankClient
from cluster.replica_set import QueueFull, ReplicaSet
from cluster.routing.load_board import BOARD
from cluster.routing.policies import RouteRequest, make_policy


def _replica_set(replicas=("a", "b"), ongoing=2, queued=1) -> ReplicaSet:
    rs = ReplicaSet("app", "ingress-test", None, make_policy("round_robin"), 1, ongoing, queued, "ray")
    rs.clients = {r: RankClient(None, r, "ingress-test", None, 1, transport="ray") for r in replicas}
    return rs


def _take(rs: ReplicaSet, client: RankClient, rid: str) -> None:
    """What `RankClient.generate` does first: the request now streams through the client."""
    client._requests[rid] = asyncio.Queue()


def _request(rid: str, exclude=()) -> RouteRequest:
    return RouteRequest(rid, [1, 2, 3], 4, exclude=frozenset(exclude))


def test_a_full_set_queues_up_to_its_limit_then_refuses_and_a_freed_slot_lets_one_go():
    async def run():
        rs = _replica_set()
        for i in range(4):  # two a replica
            client = await rs.acquire(_request(f"r{i}"))
            _take(rs, client, f"r{i}")
        assert sorted(len(c) for c in rs.clients.values()) == [2, 2]
        waiting = asyncio.ensure_future(rs.acquire(_request("w")))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        with pytest.raises(QueueFull, match="queue is full"):
            await rs.acquire(_request("x"))  # one waits already: max_queued_requests 1
        b = rs.clients["b"]
        b._requests.pop(next(iter(b._requests)))  # one of b's requests ended
        rs.release()
        return (await asyncio.wait_for(waiting, 5)).replica

    assert asyncio.run(run()) == "b"  # the replica with room
    for rid in ("r0", "r1", "r2", "r3", "w"):
        BOARD.finished(rid)


def test_a_replica_set_aside_or_excluded_is_not_chosen_while_another_can_take_the_request():
    async def run():
        rs = _replica_set()
        rs.set_replica_aside("a")
        chosen = [(await rs.acquire(_request(f"s{i}"))).replica for i in range(3)]
        rs.set_aside.clear()
        retried = [(await rs.acquire(_request(f"e{i}", exclude={"b"}))).replica for i in range(3)]
        rs.set_replica_aside("a")
        rs.set_replica_aside("b")
        with pytest.raises(LookupError):
            await rs.acquire(_request("none"))
        return chosen, retried

    chosen, retried = asyncio.run(run())
    assert chosen == ["b", "b", "b"] and retried == ["a", "a", "a"]
    for rid in [f"s{i}" for i in range(3)] + [f"e{i}" for i in range(3)]:
        BOARD.finished(rid)
