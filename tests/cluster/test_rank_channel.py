"""Rank 0's Unix socket, the same-node data plane: only a caller with the secret gets in; a
caller's submits and aborts arrive in order and its requests' updates come back as one item a
step, written by the loop thread; a refusal comes back as an update; a caller that leaves, or
stops reading, has its requests aborted and frees their ids. Driven without Ray: a real socket,
the rank actor's own methods, the rank loop replaced by a stand-in."""

import asyncio
import os
import socket
import stat
import threading
import time
import types

from cluster import rank_channel
from cluster.rank_actor import RankActor
from cluster.rank_channel import ChannelClient, ChannelServer, frame
from cluster.rank_client import RankClient, SocketLink
from workers.engine import RequestOutput
from workers.rank_loop import Update


class _Loop:
    """A rank loop that records what it is asked to do."""

    engine = types.SimpleNamespace(host_can_pause=False)

    def __init__(self) -> None:
        self.submitted: list[str] = []
        self.aborted: list[str] = []

    def submit(self, rid, prompt_ids, sampling, follows=None) -> None:
        if sampling.max_new_tokens < 1:
            raise ValueError("sampling.max_new_tokens: must be >= 1")
        self.submitted.append(rid)

    def abort(self, rid) -> None:
        self.aborted.append(rid)

    def load(self) -> dict:
        return {"running": len(self.submitted)}


def _rank_actor() -> RankActor:
    actor = object.__new__(RankActor)
    actor._trace_contexts, actor.tracer, actor.loop, actor.rank = {}, None, _Loop(), 0
    actor._outboxes, actor._reader_of, actor._sent, actor.draining = {}, {}, threading.Event(), False
    actor._claims, actor._aio = threading.Lock(), None
    actor.channel = ChannelServer(actor._on_channel_message, actor._on_channel_close)
    return actor


async def _until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


def _output(tokens: list[int]) -> RequestOutput:
    return RequestOutput("r", [1, 2], tokens, "length", cached_tokens=0)


def test_the_socket_is_private_and_a_caller_without_the_secret_is_refused():
    got, closed = [], []
    server = ChannelServer(lambda conn, message: got.append(message), closed.append)
    try:
        assert stat.S_IMODE(os.stat(os.path.dirname(server.path)).st_mode) == 0o700
        with socket.socket(socket.AF_UNIX) as sock:
            sock.connect(server.path)
            sock.sendall(b"x" * len(server.secret) + frame({"reader": "intruder"}) + frame(("abort", "a")))
            sock.settimeout(5)
            try:
                assert sock.recv(1) == b""  # closed without reading on
            except ConnectionResetError:  # closed with the frames unread
                pass
    finally:
        server.close()
    assert got == [] and closed == [] and not os.path.exists(server.path)


def test_a_callers_requests_stream_over_the_socket_one_item_a_step_written_by_the_loop_thread():
    actor = _rank_actor()

    async def run():
        client = await ChannelClient.connect(actor.channel.path, actor.channel.secret, "ingress-x")
        items = []
        reading = asyncio.ensure_future(client.run(items.append))
        client.send(("submit", "a", [1, 2], {"max_new_tokens": 4}, None))
        client.send(("submit", "b", [3], {"max_new_tokens": 4}, None))
        client.send(("submit", "bad", [3], {"max_new_tokens": 0}, None))
        client.send(("abort", "b"))
        await _until(lambda: actor.loop.aborted == ["b"] and items)
        assert actor.loop.submitted == ["a", "b"]  # in the order sent, the abort after them
        refusal = items.pop()  # answered on the socket, not raised
        assert refusal["updates"][0]["request_id"] == "bad"
        assert refusal["updates"][0]["error"]["code"] == "invalid_argument"
        steps = [
            [Update("a", [10], False), Update("b", [], True, _output([]))],
            [Update("a", [11], True, _output([10, 11]))],
        ]
        for step in steps:  # as the loop thread hands them over; no event loop involved
            await asyncio.to_thread(actor._on_updates, step)
        await _until(lambda: len(items) == 2)
        client.close()
        await reading
        return items

    first, second = asyncio.run(run())
    assert [(u["request_id"], u["token_ids"], u["finished"]) for u in first["updates"]] == [
        ("a", [10], False),
        ("b", [], True),
    ]
    assert first["load"] == {"running": 2}  # an item that finishes a request says the rank's load
    assert second["updates"][0]["token_ids"] == [11] and second["updates"][0]["completion_tokens"] == 2
    assert actor._reader_of == {} and actor._outboxes == {}  # ids free again; nothing went through Ray
    actor.channel.close()


def test_a_caller_that_leaves_has_its_requests_aborted_and_their_last_updates_dropped():
    actor = _rank_actor()

    async def run():
        client = await ChannelClient.connect(actor.channel.path, actor.channel.secret, "ingress-x")
        client.send(("submit", "a", [1], {"max_new_tokens": 4}, None))
        await _until(lambda: actor.loop.submitted == ["a"])
        client.close()
        await _until(lambda: actor.loop.aborted == ["a"])
        assert actor._reader_of == {"a": None}  # held until the abort's last update, then free
        actor._on_updates([Update("a", [], True, _output([]))])

    asyncio.run(run())
    assert actor._reader_of == {} and actor.channel.connections == set()
    actor.channel.close()


def test_a_caller_that_stops_reading_is_cut_off_without_stalling_the_loop_thread(monkeypatch):
    monkeypatch.setattr(rank_channel, "SEND_TIMEOUT_S", 0.2)
    monkeypatch.setattr(rank_channel, "SEND_BUFFER_BYTES", 1 << 16)
    actor = _rank_actor()

    async def run():
        client = await ChannelClient.connect(actor.channel.path, actor.channel.secret, "stuck")
        client.send(("submit", "a", [1], {"max_new_tokens": 4}, None))
        await _until(lambda: actor.loop.submitted == ["a"])
        big = [Update("a", list(range(50_000)), False)]  # never read: the socket fills up
        loop_thread = threading.Thread(target=lambda: [actor._on_updates(big) for _ in range(40)], daemon=True)
        loop_thread.start()
        await asyncio.to_thread(loop_thread.join, 3.0)
        stalled = loop_thread.is_alive()
        await _until(lambda: actor.loop.aborted == ["a"])
        client.close()
        return stalled

    stalled = asyncio.run(run())
    assert not stalled  # one bounded wait, then every later send is a no-op
    assert actor.channel.connections == set()
    actor.channel.close()


def test_the_client_streams_through_the_socket_and_a_rank_that_goes_away_fails_its_requests():
    """`RankClient` on a socket link end to end against a rank actor's socket: tokens stream, and
    when rank 0 closes the socket (it stopped or died) the waiting request ends UNAVAILABLE."""
    actor = _rank_actor()

    async def run():
        client = RankClient(None, "rep", "ingress-x", None, 1, transport="socket")
        channel = await ChannelClient.connect(actor.channel.path, actor.channel.secret, "ingress-x")

        async def connect():
            return SocketLink(channel)

        client._connect = connect
        from workers.sampling_params import SamplingParams

        stream = client.generate("a", [1, 2], SamplingParams(max_new_tokens=4), [])
        first = asyncio.ensure_future(stream.__anext__())
        await _until(lambda: actor.loop.submitted == ["a"])
        await asyncio.to_thread(actor._on_updates, [Update("a", [10], False)])
        got = await asyncio.wait_for(first, 5)
        actor.channel.close()  # rank 0 goes away
        last = await asyncio.wait_for(stream.__anext__(), 5)
        return got, last

    got, last = asyncio.run(run())
    assert got["token_ids"] == [10] and not got["finished"]
    assert last["finished"] and last["error"]["code"] == "unavailable"
