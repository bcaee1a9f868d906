"""When the consumer of a request's stream falls behind, the rank actor and the replica send
everything that is ready as one update (tokens concatenated, the latest fields), and never hold
back an update that is alone: the first token goes out at once. Driven without Ray, on the
classes' own generate methods with the loop and the Ray stream replaced by stand-ins."""

import asyncio

from cluster.rank_actor import RankActor
from cluster.replica import LLMServer
from workers.engine import RequestOutput
from workers.rank_loop import Update
from workers.sampling_params import SamplingParams


class _Loop:
    """A rank loop that takes requests and lets the test hand out their updates."""

    def __init__(self, actor: RankActor) -> None:
        self.actor = actor

    def submit(self, rid, prompt_ids, sampling) -> None:
        pass

    def abort(self, rid) -> None:
        pass


def _output(tokens: list[int]) -> RequestOutput:
    return RequestOutput("r", [1, 2], tokens, "length", cached_tokens=0)


def test_the_rank_actor_merges_the_updates_that_queued_up():
    actor = object.__new__(RankActor)
    actor._streams, actor._trace_contexts, actor.tracer = {}, {}, None
    actor.loop = _Loop(actor)

    async def run():
        stream = actor.generate("r", [1, 2], {"max_new_tokens": 4})
        first_task = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)
        queue = actor._streams["r"]
        queue.put_nowait(Update("r", [10], False))
        first = await first_task  # alone in the queue: sent at once
        for update in (
            Update("r", [11], False),
            Update("r", [12], False),
            Update("r", [13], True, _output([10, 11, 12, 13])),
        ):
            queue.put_nowait(update)
        rest = [u async for u in stream]
        return first, rest

    first, rest = asyncio.run(run())
    assert first["token_ids"] == [10] and not first["finished"]
    assert len(rest) == 1 and rest[0]["token_ids"] == [11, 12, 13] and rest[0]["finished"]
    assert rest[0]["completion_tokens"] == 4 and rest[0]["finish_reason"] == "length"


class _Stream:
    """A Ray streaming generator's stand-in: refs are futures the test resolves."""

    def __init__(self, updates: list[asyncio.Future]) -> None:
        self.updates = list(updates)

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.updates:
            raise StopAsyncIteration
        return self.updates.pop(0)

    def next_ready(self) -> bool:
        return bool(self.updates) and self.updates[0].done()

    def completed(self) -> bool:
        return not self.updates


class _Method:
    def __init__(self, stream) -> None:
        self.stream = stream

    def options(self, **_):
        return self

    def remote(self, *_):
        return self.stream


class _Replica(LLMServer):
    def __del__(self) -> None:
        """No rank actors to stop (and no Ray to start by trying)."""


def test_the_replica_merges_what_is_ready_and_sends_a_lone_update_at_once():
    replica = object.__new__(_Replica)
    replica.replica_tag, replica.tokenizer = "rep", None

    async def parse(body):
        return "r", [1, 2], SamplingParams(max_new_tokens=4), []

    async def load():
        return {"replica": "rep"}

    replica._parse, replica.load = parse, load

    async def run():
        loop = asyncio.get_running_loop()
        refs = [loop.create_future() for _ in range(4)]
        replica.ranks = [type("Rank", (), {"generate": _Method(_Stream(refs))})()]
        stream = replica.generate({})
        refs[0].set_result({"token_ids": [10], "finished": False})
        first = await stream.__anext__()  # nothing else is ready: not held back
        for ref, update in zip(refs[1:], ([11], [12], [13])):
            ref.set_result({"token_ids": update, "finished": update == [13], "finish_reason": "length"})
        return first, [u async for u in stream]

    first, rest = asyncio.run(run())
    assert first["token_ids"] == [10]
    assert len(rest) == 1 and rest[0]["token_ids"] == [11, 12, 13] and rest[0]["finished"]
    assert rest[0]["replica"] == "rep" and rest[0]["load"] == {"replica": "rep"}
