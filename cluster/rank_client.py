"""One caller's connection to a replica's rank-0 actor: submit requests, read their updates from
one stream, and turn each request's updates into what a caller streams.

Two callers use it: the replica deployment (for Serve handle callers) and the ingress, which
reaches every replica's rank 0 directly on the hot path (no Serve handle and no replica actor in
between: two fewer Ray hops each way). Each has its own `reader` on rank 0, so each stream only
carries its own requests. The link to rank 0 is its Unix socket when both are on one node
(`cluster/rank_channel.py`), otherwise Ray (an actor call per request, a streaming generator).

Per request: updates that queued up while the caller was behind go out as one; after the first,
an update waits for `stream_interval` tokens (or the end); text is detokenized incrementally and
cut at a stop string (which ends the request); the last update carries the replica's load. A
request that fails ends with an update carrying `error` ({code, message}).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import Any, Literal

import ray

from cluster.rank_actor import error_update, join_updates
from cluster.rank_channel import ChannelClient
from workers.error_codes import ErrorCode
from workers.sampling_params import SamplingParams
from workers.tokenizer import IncrementalDetokenizer, StopStrings

logger = logging.getLogger(__name__)


def unwrap(exc: BaseException) -> BaseException:
    """The exception a Ray task raised, without Ray's wrapper (and its remote traceback)."""
    return getattr(exc, "cause", None) or exc


Transport = Literal["socket", "ray"]


class RayLink:
    """Rank 0 through Ray: a submit is an actor call, updates come from the reader's streaming
    generator."""

    def __init__(self, rank0, reader: str) -> None:
        self.rank0 = rank0
        self.reader = reader
        self._updates = None  # the stream (a Ray streaming generator)

    async def submit(
        self, rid: str, prompt_ids: list[int], sampling: dict, trace_context, follows: str | None
    ) -> dict[str, Any] | None:
        return await self.rank0.submit.remote(rid, prompt_ids, sampling, trace_context, self.reader, follows)

    def abort(self, rid: str) -> None:
        """Outside the calling request's Ray task: Ray cancels the calls a cancelled request made,
        and this one must still arrive."""
        contextvars.Context().run(self.rank0.abort.remote, rid)

    async def run(self, deliver) -> None:
        self._updates = stream = self.rank0.updates.options(num_returns="streaming").remote(self.reader)
        async for ref in stream:
            deliver(await ref)

    def close(self) -> None:
        if self._updates is not None:
            ray.cancel(self._updates)


class SocketLink:
    """Rank 0 over its Unix socket: submits and aborts are written in order, refusals come back
    as updates."""

    def __init__(self, channel: ChannelClient) -> None:
        self.channel = channel

    async def submit(self, rid: str, prompt_ids: list[int], sampling: dict, trace_context, follows: str | None) -> None:
        self.channel.send(("submit", rid, prompt_ids, sampling, trace_context, follows))

    def abort(self, rid: str) -> None:
        self.channel.send(("abort", rid))

    async def run(self, deliver) -> None:
        await self.channel.run(deliver)

    def close(self) -> None:
        self.channel.close()


class RankClient:
    def __init__(
        self, rank0, replica: str, reader: str, tokenizer, stream_interval: int, *, transport: Transport
    ) -> None:
        self.rank0 = rank0
        self.replica = replica
        self.reader = reader
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        self.transport = transport
        self.last_load: dict[str, Any] = {}
        self._requests: dict[str, asyncio.Queue] = {}  # request id -> the updates rank 0 sent for it
        self.link: RayLink | SocketLink | None = None
        self._reading: asyncio.Task | None = None  # the task reading the link
        self._opening = asyncio.Lock()

    def __contains__(self, rid: str) -> bool:
        return rid in self._requests

    def __len__(self) -> int:
        """Requests streaming through this client now."""
        return len(self._requests)

    async def generate(
        self,
        rid: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        stop: list[str],
        trace_context: dict[str, str] | None = None,
        follows: str | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        """Run a request on rank 0 and stream its updates (see the module's docstring);
        `follows`: another choice of the same prompt, submitted before (`Engine.add_request`)."""
        detok = IncrementalDetokenizer(self.tokenizer) if self.tokenizer is not None else None
        stops, emitted, finished, held = StopStrings(stop), 0, False, None
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._requests[rid] = queue  # counted (admission, duplicate ids) from now on
        try:
            refused = await self._submit(rid, prompt_ids, sampling, trace_context, follows)
            if refused is not None:
                queue.put_nowait(refused)
            while not finished:
                update = await queue.get()
                if held is not None:
                    update = join_updates(held, update)
                while not update["finished"] and not queue.empty():
                    update = join_updates(update, queue.get_nowait())
                held = None
                if not update["finished"] and emitted and len(update["token_ids"]) < self.stream_interval:
                    held = update  # the first tokens go out at once, later ones stream_interval at a time
                    continue
                update["request_id"], update["replica"] = rid, self.replica
                emitted += len(update["token_ids"])
                if detok is not None:
                    delta = detok.add(update["token_ids"], final=update["finished"])
                    update["text"] = stops.add(delta, final=update["finished"])
                    if stops.stopped and "error" not in update:
                        update.update(
                            finished=True,
                            finish_reason="stop",
                            prompt_tokens=len(prompt_ids),
                            completion_tokens=emitted,
                        )
                finished = update["finished"]
                if finished:  # rank 0's load as of this update (it comes with the update's item)
                    update["load"] = {"replica": self.replica, **self.last_load}
                    self._release(rid, queue)  # its id is free again before the caller hears
                yield update
        finally:
            self._release(rid, queue)
            if not finished or stops.stopped:  # cancelled, failed or cut at a stop string: free the KV
                self.abort(rid)

    def _release(self, rid: str, queue: asyncio.Queue) -> None:
        """Stop routing `rid`'s updates to `queue`, unless the id already routes to a newer
        request's."""
        if self._requests.get(rid) is queue:
            del self._requests[rid]

    async def _submit(
        self,
        rid: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        trace_context: dict[str, str] | None,
        follows: str | None = None,
    ) -> dict[str, Any] | None:
        """Open the link if needed and hand the request to rank 0; None, or the update that ends
        it at once. A submit that failed without rank 0 dying (cancelled, say) may still have
        queued the request: it is aborted, so that a retry of the same id finds it gone."""
        try:
            link = await self._open()
            return await link.submit(rid, prompt_ids, dataclasses.asdict(sampling), trace_context, follows)
        except ray.exceptions.RayError as exc:
            if not isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)):
                self.abort(rid)
            return self._lost(rid, exc)

    def abort(self, rid: str) -> None:
        """Abort a request on rank 0 (a no-op before the link is open: nothing was sent)."""
        if self.link is not None:
            self.link.abort(rid)

    def _lost(self, rid: str, exc: BaseException) -> dict[str, Any]:
        return error_update(ErrorCode.UNAVAILABLE, f"request {rid!r} failed in replica {self.replica}: {unwrap(exc)!r}")

    async def _open(self) -> RayLink | SocketLink:
        """The link to rank 0, opened (and its reading task started) at the first request and
        again after a break: the socket when rank 0 offers one on this node, Ray otherwise. The
        task runs in a context of its own: in an async actor Ray takes the calling task from the
        context, and a stream opened as a request's child would be cancelled with that request
        (breaking it for every other request)."""
        async with self._opening:
            if self._reading is not None and not self._reading.done():
                return self.link
            link = await self._connect()
            self.link = link
            self._reading = asyncio.get_running_loop().create_task(self._read(link), context=contextvars.Context())
            return link

    async def _connect(self) -> RayLink | SocketLink:
        if self.transport == "socket":
            address = await self.rank0.channel_address.remote()
            if address is not None and address["node_id"] == ray.get_runtime_context().get_node_id():
                try:
                    return SocketLink(await ChannelClient.connect(address["path"], address["secret"], self.reader))
                except OSError as exc:
                    logger.warning("replica %s: rank 0's socket refused (%s); streaming through Ray", self.replica, exc)
        return RayLink(self.rank0, self.reader)

    def close(self, why: BaseException) -> None:
        """Stop reading (rank 0's side is closed too, so that it aborts this reader's requests at
        once); every request still waiting ends UNAVAILABLE."""
        if self._reading is not None:
            self._reading.cancel()
        if self.link is not None:
            self.link.close()
        self._fail_all(why)

    def _deliver(self, item: dict[str, Any]) -> None:
        if "load" in item:
            self.last_load = item["load"]
        for update in item["updates"]:
            queue = self._requests.get(update["request_id"])
            if queue is not None:
                queue.put_nowait(update)

    async def _read(self, link: RayLink | SocketLink) -> None:
        """Hand each request its updates from the link. When it breaks (a rank died) or ends,
        every request waiting here ends with UNAVAILABLE (the next request opens it again) and
        is aborted on rank 0, which may still be running it: a retry of the same id must find
        it gone."""
        try:
            await link.run(self._deliver)
            broke: BaseException = RuntimeError("rank 0's update stream ended")
        except Exception as exc:  # noqa: BLE001 - a Ray error, a broken socket: every request hears
            broke = exc
        logger.error("replica %s: rank 0's update stream broke: %s", self.replica, unwrap(broke))
        self._fail_all(broke)

    def _fail_all(self, why: BaseException) -> None:
        for rid, queue in list(self._requests.items()):
            self.abort(rid)
            queue.put_nowait(self._lost(rid, why))
