"""Rank 0 streams all of a replica's requests as one stream, one item per step (fewer while the
replica is behind); the replica hands each request its updates and, when that request's caller
falls behind, sends everything that is ready as one update (tokens concatenated, the latest
fields, the first token's queue and prefill times kept). Nothing alone is held back: the first
token goes out at once. Driven without Ray, on the classes' own methods with the rank loop and
the Ray calls replaced by stand-ins."""

import asyncio
import contextvars
import threading
import types

import pytest

from cluster.rank_actor import HAND_OVER_WAIT_S, REPLICA_READER, RankActor
from cluster.rank_client import RankClient
from cluster.replica import LLMServer
from workers.engine import RequestOutput
from workers.rank_loop import Update
from workers.sampling_params import SamplingParams


class _Loop:
    """A rank loop that takes requests; the test hands out their updates."""

    engine = types.SimpleNamespace(host_can_pause=False)

    def submit(self, rid, prompt_ids, sampling, follows=None) -> None:
        pass

    def abort(self, rid) -> None:
        pass

    def load(self) -> dict:
        return {"running": 0}


def _output(tokens: list[int]) -> RequestOutput:
    return RequestOutput("r", [1, 2], tokens, "length", cached_tokens=0)


def _rank_actor() -> RankActor:
    actor = object.__new__(RankActor)
    actor._trace_contexts, actor.tracer, actor.loop, actor.rank = {}, None, _Loop(), 0
    actor._outboxes, actor._reader_of, actor._sent, actor.draining = {}, {}, threading.Event(), False
    actor._claims, actor.channel, actor._aio = threading.Lock(), None, None
    return actor


async def _steps(actor: RankActor, *steps: list[Update]) -> None:
    """Hand steps' updates over as the loop thread does (routed, then to the event loop)."""
    actor._aio = asyncio.get_running_loop()
    for updates in steps:
        actor._on_updates(updates)


def test_the_rank_actor_streams_every_request_in_one_item_per_step_and_joins_what_queued_up():
    actor = _rank_actor()

    async def run():
        assert actor.submit("a", [1, 2], {"max_new_tokens": 4}) is None
        assert actor.submit("b", [3], {"max_new_tokens": 4}) is None
        stream = actor.updates()
        first_task = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)
        await _steps(actor, [Update("a", [10], False), Update("b", [20], False)])  # one step, two requests
        first = await first_task  # sent at once
        await _steps(  # the reader is behind: three steps wait
            actor,
            [Update("a", [11], False), Update("b", [21], False)],
            [Update("a", [12], False), Update("b", [22], True, _output([20, 21, 22]))],
            [Update("a", [13], True, _output([10, 11, 12, 13]))],
        )
        await asyncio.sleep(0)
        assert not actor._sent.is_set()  # the first item is out, the stream not yet back for more
        second = await stream.__anext__()
        assert actor._sent.is_set()  # taking the next item says the first went out
        return first, second

    first, second = asyncio.run(run())
    assert first == {
        "updates": [
            {"request_id": "a", "token_ids": [10], "finished": False, "cached_tokens": 0},
            {"request_id": "b", "token_ids": [20], "finished": False, "cached_tokens": 0},
        ]
    }
    a, b = second["updates"]
    assert a["token_ids"] == [11, 12, 13] and a["finished"] and a["completion_tokens"] == 4
    assert b["token_ids"] == [21, 22] and b["finished"] and b["finish_reason"] == "length"
    assert second["load"] == {"running": 0}  # an item that finishes a request says the rank's load
    assert actor._reader_of == {}  # finished requests' ids are free again


def test_the_rank_actor_refuses_bad_input_with_an_update():
    actor = _rank_actor()

    def refuse(rid, prompt_ids, sampling, follows=None):
        raise ValueError("sampling.top_p: must be in (0, 1]")

    actor.loop.submit = refuse
    refused = actor.submit("a", [1], {"top_p": 2.0})
    assert refused["finished"] and refused["error"]["code"] == "invalid_argument"
    assert "top_p" in refused["error"]["message"]
    assert actor._reader_of == {}  # the id is not held by a request that never ran


REQUEST_TASK = contextvars.ContextVar("request_task")  # as Ray keeps an async actor's current task


class _Rank:
    """Rank 0's stand-in: `submit` answers at once; `updates` is a stream the test feeds."""

    def __init__(self, items: asyncio.Queue) -> None:
        self.items = items
        self.aborted: list[str] = []
        self.submit_error: BaseException | None = None
        self.opened_in: list[str | None] = []  # the calling request as the stream was opened
        outer = self

        class _Submit:
            def remote(self, *args):
                future = asyncio.get_running_loop().create_future()
                if outer.submit_error is None:
                    future.set_result(None)
                else:
                    future.set_exception(outer.submit_error)
                return future

        class _Updates:
            def options(self, **_):
                return self

            def remote(self, reader):
                outer.opened_in.append(REQUEST_TASK.get(None))
                return outer._stream()

        class _Abort:
            def remote(self, rid):
                outer.aborted.append(rid)

        self.submit, self.updates, self.abort = _Submit(), _Updates(), _Abort()

    async def _stream(self):
        while True:
            item = await self.items.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:  # the stream ends
                return
            future = asyncio.get_running_loop().create_future()
            future.set_result(item)
            yield future


class _Replica(LLMServer):
    def __del__(self) -> None:
        """No rank actors to stop (and no Ray to start by trying)."""


def _replica(items: asyncio.Queue, stream_interval: int = 1) -> _Replica:
    replica = object.__new__(_Replica)
    replica.replica_tag, replica.tokenizer = "rep", None
    replica.ranks = [_Rank(items)]
    replica.client = RankClient(replica.ranks[0], "rep", REPLICA_READER, None, stream_interval, transport="ray")

    async def parse(body):
        return body["rid"], [1, 2], SamplingParams(max_new_tokens=4), []

    replica._parse = parse
    return replica


def _up(rid: str, tokens: list[int], finished: bool = False) -> dict:
    return {"request_id": rid, "token_ids": tokens, "finished": finished, "finish_reason": "length"}


def test_the_replica_hands_out_one_stream_and_merges_what_is_ready_per_request():
    async def run():
        items = asyncio.Queue()
        replica = _replica(items)
        a, b = replica.generate({"rid": "a"}), replica.generate({"rid": "b"})
        first_a, first_b = asyncio.ensure_future(a.__anext__()), asyncio.ensure_future(b.__anext__())
        await asyncio.sleep(0.01)
        items.put_nowait({"updates": [_up("a", [10]), _up("b", [20])]})
        first = (await first_a, await first_b)  # alone: not held back
        items.put_nowait({"updates": [_up("a", [11]), _up("b", [21])]})
        items.put_nowait({"updates": [_up("a", [12], True), _up("b", [22])], "load": {"running": 1}})
        items.put_nowait({"updates": [_up("b", [23], True)], "load": {"running": 0}})
        await asyncio.sleep(0.01)  # all of it ready before the callers read again
        rest_a, rest_b = [u async for u in a], [u async for u in b]
        return first, rest_a, rest_b, replica

    (first_a, first_b), rest_a, rest_b, replica = asyncio.run(run())
    assert first_a["token_ids"] == [10] and first_b["token_ids"] == [20]
    assert len(rest_a) == 1 and rest_a[0]["token_ids"] == [11, 12] and rest_a[0]["finished"]
    assert len(rest_b) == 1 and rest_b[0]["token_ids"] == [21, 22, 23] and rest_b[0]["finished"]
    assert rest_a[0]["replica"] == "rep" and rest_b[0]["load"] == {"replica": "rep", "running": 0}
    assert len(replica.client) == 0 and replica.ranks[0].aborted == []


@pytest.mark.parametrize("ending", ["rank died", "stream ended"])
def test_a_broken_update_stream_ends_every_waiting_request_unavailable_and_aborts_it(ending):
    import ray

    async def run():
        items = asyncio.Queue()
        replica = _replica(items)
        a = replica.generate({"rid": "a"})
        first = asyncio.ensure_future(a.__anext__())
        await asyncio.sleep(0.01)
        items.put_nowait(ray.exceptions.RayActorError() if ending == "rank died" else None)
        return await asyncio.wait_for(first, 5), replica.ranks[0].aborted

    update, aborted = asyncio.run(run())
    assert update["finished"] and update["error"]["code"] == "unavailable"
    assert "'a'" in update["error"]["message"]
    assert aborted == ["a"]  # rank 0 may still run it: a retry of "a" must not find it there


def test_stream_interval_sends_the_first_token_at_once_then_groups():
    async def run():
        items = asyncio.Queue()
        replica = _replica(items, stream_interval=3)
        stream = replica.generate({"rid": "a"})
        got = []

        async def read():
            async for update in stream:
                got.append(update["token_ids"])

        reader = asyncio.ensure_future(read())
        for step, tokens in enumerate([[10], [11], [12], [13], [14], [15], [16]]):
            items.put_nowait({"updates": [_up("a", tokens, step == 6)]})
            await asyncio.sleep(0.01)  # the caller keeps up: nothing joins by being late
        await asyncio.wait_for(reader, 5)
        return got

    assert asyncio.run(run()) == [[10], [11, 12, 13], [14, 15, 16]]


def test_a_submit_that_failed_without_rank_0_dying_is_aborted_before_the_caller_hears():
    """A cancelled submit may have queued the request: the replica aborts it, so that the
    gateway's retry of the same id is not refused as a duplicate."""
    import ray

    async def run():
        replica = _replica(asyncio.Queue())
        replica.ranks[0].submit_error = ray.exceptions.TaskCancelledError()
        updates = [u async for u in replica.generate({"rid": "a"})]
        return updates, replica.ranks[0].aborted

    updates, aborted = asyncio.run(run())
    assert len(updates) == 1 and updates[0]["error"]["code"] == "unavailable"
    assert aborted == ["a"]


def test_the_update_stream_is_not_opened_as_a_child_of_the_first_request():
    """Ray cancels the calls a cancelled request made; the replica's one stream must not be one."""

    async def run():
        replica = _replica(asyncio.Queue())

        async def first_request():
            REQUEST_TASK.set("request-1")
            stream = replica.generate({"rid": "a"})
            task = asyncio.ensure_future(stream.__anext__())
            await asyncio.sleep(0.01)
            task.cancel()

        await first_request()
        return replica.ranks[0].opened_in

    assert asyncio.run(run()) == [None]


@pytest.mark.parametrize("can_pause", [True, False])
def test_the_loop_thread_waits_for_the_hand_over_only_when_the_device_would_not_idle(can_pause):
    """With the next step launched (or on CPU), the loop thread waits (up to HAND_OVER_WAIT_S)
    until the stream took the step's updates; a GPU with nothing in flight (a speculative round,
    a prefill) would idle through that wait, so it hands over and goes on."""
    actor = _rank_actor()
    actor.loop = types.SimpleNamespace(engine=types.SimpleNamespace(host_can_pause=can_pause))
    waits = []
    actor._sent = types.SimpleNamespace(clear=lambda: None, wait=waits.append)

    async def run():
        actor._aio = asyncio.get_running_loop()
        actor._reader_of["a"] = REPLICA_READER  # as `submit` records it
        await asyncio.to_thread(actor._on_updates, [Update("a", [10], False)])
        await asyncio.sleep(0)
        return actor._outboxes[REPLICA_READER].updates

    assert asyncio.run(run())["a"]["token_ids"] == [10]  # handed over either way
    assert waits == ([HAND_OVER_WAIT_S] if can_pause else [])


def test_each_reader_gets_only_its_own_requests_and_a_reader_that_leaves_has_them_aborted():
    """The ingress and the replica read rank 0 side by side; a newer stream of a reader ends the
    older one without aborting anything, and a reader whose stream closes (its consumer left)
    has its requests aborted: nobody would read their tokens."""
    actor = _rank_actor()
    aborted = []
    actor.loop.abort = aborted.append

    async def run():
        actor.submit("i1", [1], {"max_new_tokens": 4}, None, "ingress-x")
        actor.submit("r1", [1], {"max_new_tokens": 4})
        ingress, replica = actor.updates("ingress-x"), actor.updates()
        got_i, got_r = asyncio.ensure_future(ingress.__anext__()), asyncio.ensure_future(replica.__anext__())
        await asyncio.sleep(0)
        await _steps(actor, [Update("i1", [10], False), Update("r1", [20], False)])
        first_i, first_r = await got_i, await got_r
        newer = actor.updates()  # the replica reopens its stream: the older one ends
        newer_first = asyncio.ensure_future(newer.__anext__())
        await asyncio.sleep(0)
        with pytest.raises(StopAsyncIteration):
            await replica.__anext__()
        assert aborted == []
        await ingress.aclose()  # the ingress went away
        await _steps(actor, [Update("i1", [11], True, _output([10, 11])), Update("r1", [21], True, _output([20, 21]))])
        return first_i, first_r, await newer_first

    first_i, first_r, newer_first = asyncio.run(run())
    assert [u["request_id"] for u in first_i["updates"]] == ["i1"]
    assert [u["request_id"] for u in first_r["updates"]] == ["r1"]
    assert [u["request_id"] for u in newer_first["updates"]] == ["r1"]  # i1's last update is nobody's now
    assert newer_first["updates"][0]["token_ids"] == [21] and newer_first["updates"][0]["finished"]
    assert aborted == ["i1"] and "ingress-x" not in actor._outboxes and actor._reader_of == {}


def test_a_draining_rank_refuses_new_requests_and_waits_for_the_running_ones():
    actor = _rank_actor()
    actor.loop = types.SimpleNamespace(in_flight=2, submit=lambda *a: None)

    async def finish_them():
        for _ in range(2):
            await asyncio.sleep(0.06)
            actor.loop.in_flight -= 1

    async def run():
        finishing = asyncio.ensure_future(finish_them())
        left = await actor.drain(timeout_s=10)
        await finishing
        return left

    assert asyncio.run(run()) == 0  # returned once both had finished
    refused = actor.submit("late", [1], {"max_new_tokens": 2})
    assert refused["error"]["code"] == "unavailable" and "draining" in refused["error"]["message"]
    actor.loop.in_flight = 1
    assert asyncio.run(actor.drain(timeout_s=0.1)) == 1  # gives up after its timeout


def test_the_first_tokens_queue_and_prefill_times_survive_every_join():
    """The update that brings a request's first token carries the engine's queue and prefill
    times (the ingress counts them with the first token); joined with later updates, at rank 0
    for a reader that is behind or at the replica for a caller that is behind, it keeps them."""
    actor = _rank_actor()

    async def at_rank_0():
        actor.submit("a", [1, 2], {"max_new_tokens": 4})
        stream = actor.updates()
        await _steps(actor, [Update("a", [10], False, phases=(0.25, 0.5))], [Update("a", [11], False)])
        return await stream.__anext__()

    (joined,) = asyncio.run(at_rank_0())["updates"]
    assert joined["token_ids"] == [10, 11] and (joined["queue_s"], joined["prefill_s"]) == (0.25, 0.5)

    async def at_the_replica():
        items = asyncio.Queue()
        replica = _replica(items)
        stream = replica.generate({"rid": "a"})
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.01)
        items.put_nowait({"updates": [{**_up("a", [10]), "queue_s": 0.25, "prefill_s": 0.5}]})
        items.put_nowait({"updates": [_up("a", [11])]})
        items.put_nowait({"updates": [_up("a", [12], True)]})
        return [await first] + [u async for u in stream]

    (joined,) = asyncio.run(at_the_replica())
    assert joined["token_ids"] == [10, 11, 12] and (joined["queue_s"], joined["prefill_s"]) == (0.25, 0.5)
