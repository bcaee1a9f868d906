"""The Serve deployment of one engine replica: a tensor-parallel group of rank actors.

Each replica runs in its own placement group (Serve's `placement_group_bundles`: bundle 0 for
the replica actor, one bundle per rank), starts its rank actors in that group, wires their
process group and streams requests through rank 0. Its health check fails when any rank actor
or rank loop is gone, so Serve replaces the replica; requests in flight then end with an error.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import itertools
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.config import AppArgs
from cluster.gateway import unwrap
from cluster.protocol import InvalidRequest, PromptLimits, RoutedBody, parse_request
from cluster.rank_actor import RankActor, error_update, rank_actor_name
from workers.rank_loop import ErrorCode
from workers.sampling_params import SamplingParams
from workers.tokenizer import IncrementalDetokenizer, StopStrings, load_tokenizer

logger = logging.getLogger(__name__)


class LLMServer:
    """One replica. Methods are called through Serve deployment handles (and HTTP)."""

    def __init__(self, args: dict[str, Any]) -> None:
        self.args = AppArgs(**args)
        self.engine_kwargs = self.args.engine_args().engine_kwargs()
        app, replica = _serve_ids()
        self.replica_tag = replica or uuid.uuid4().hex[:8]
        self._ids = itertools.count()
        self.tokenizer = load_tokenizer(self.engine_kwargs["model"])
        pg = ray.util.get_current_placement_group()
        actor_cls = ray.remote(RankActor)
        bundle = self.args.rank_bundles()[0]
        self.ranks = []
        for rank in range(self.args.tp_size):
            strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank + 1) if pg else None
            self.ranks.append(
                actor_cls.options(
                    num_cpus=bundle["CPU"],
                    num_gpus=bundle.get("GPU", 0),
                    scheduling_strategy=strategy,
                    name=rank_actor_name(app, self.replica_tag, rank),
                    max_concurrency=1000,
                ).remote(
                    rank,
                    self.args.tp_size,
                    self.engine_kwargs,
                    self.args.torch_threads_per_rank,
                    tracing=self.args.tracing.model_dump(),
                    stall_timeout_s=self.args.stall_timeout_s,
                )
            )
        addr, port = ray.get(self.ranks[0].address.remote())
        self.info = ray.get([a.setup.remote(addr, port) for a in self.ranks])[0]
        self.limits = PromptLimits.of(self.info["context_length"], self.tokenizer)
        self._requests: dict[str, asyncio.Queue] = {}  # request id -> the updates rank 0 sent for it
        self._reader: asyncio.Task | None = None
        self._last_load: dict[str, Any] = {}
        logger.info("replica %s: %d rank(s) up: %s", self.replica_tag, len(self.ranks), self.info)

    # -- requests ------------------------------------------------------------------------------
    async def generate(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Stream a request: dicts with new `token_ids` (and `text` when the model has a
        tokenizer); the last carries finish reason, usage, speculative statistics and this
        replica's load. A stop string ends the request (its text is cut before the stop).
        A request that fails ends with an update carrying `error` ({code, message}); invalid
        input is answered that way too, never raised (it is not a fault of the replica).
        While the caller is behind, everything that is ready goes out as one update; after the
        first, an update waits for `stream_interval` tokens (or the end)."""
        try:
            rid, prompt_ids, sampling, stop = await self._parse(body)
        except ValueError as exc:
            yield {**error_update(ErrorCode.INVALID_ARGUMENT, str(exc)), "replica": self.replica_tag}
            return
        self._start_reader()
        detok = IncrementalDetokenizer(self.tokenizer) if self.tokenizer is not None else None
        stops, emitted, finished, held = StopStrings(stop), 0, False, None
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._requests[rid] = queue
        try:
            refused = await self._submit(rid, prompt_ids, sampling, body.get("trace_context"))
            if refused is not None:
                queue.put_nowait(refused)
            while not finished:
                update = await queue.get()
                if held is not None:
                    update = {**update, "token_ids": held["token_ids"] + update["token_ids"]}
                while not update["finished"] and not queue.empty():
                    later = queue.get_nowait()
                    update = {**later, "token_ids": update["token_ids"] + later["token_ids"]}
                held = None
                if not update["finished"] and emitted and len(update["token_ids"]) < self.args.stream_interval:
                    held = update  # the first tokens go out at once, later ones stream_interval at a time
                    continue
                update["request_id"], update["replica"] = rid, self.replica_tag
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
                    update["load"] = {"replica": self.replica_tag, **self._last_load}
                    self._requests.pop(rid, None)  # its id is free again before the caller hears
                yield update
        finally:
            self._requests.pop(rid, None)
            if not finished or stops.stopped:  # cancelled, failed or cut at a stop string: free the KV
                self._abort(rid)

    async def _submit(
        self, rid: str, prompt_ids: list[int], sampling: SamplingParams, trace_context: dict[str, str] | None
    ) -> dict[str, Any] | None:
        """Hand the request to rank 0; None, or the update that ends it at once. A submit that
        failed without rank 0 dying (cancelled, say) may still have queued the request: it is
        aborted, so that a retry of the same id finds it gone."""
        try:
            return await self.ranks[0].submit.remote(rid, prompt_ids, dataclasses.asdict(sampling), trace_context)
        except ray.exceptions.RayError as exc:
            if not isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)):
                self._abort(rid)
            return self._lost(rid, exc)

    def _abort(self, rid: str) -> None:
        """Abort a request on rank 0, outside the calling request's Ray task: Ray cancels the
        calls a cancelled request made, and this one must still arrive."""
        contextvars.Context().run(self.ranks[0].abort.remote, rid)

    def _lost(self, rid: str, exc: BaseException) -> dict[str, Any]:
        return error_update(
            ErrorCode.UNAVAILABLE, f"request {rid!r} failed in replica {self.replica_tag}: {unwrap(exc)!r}"
        )

    def _start_reader(self) -> None:
        """Read rank 0's update stream (once per replica, from the first request on). The task
        runs in a context of its own: in an async actor Ray takes the calling task from the
        context, and a stream opened as a request's child would be cancelled with that request
        (breaking it for every other request)."""
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read_updates(), context=contextvars.Context())

    async def _read_updates(self) -> None:
        """Hand each request its updates from rank 0's one stream. When the stream breaks (a rank
        died) or ends, every request waiting here ends with UNAVAILABLE (the next request opens
        the stream again) and is aborted on rank 0, which may still be running it: a retry of
        the same id must find it gone. A dead rank fails the health check, and Serve replaces
        the replica."""
        stream = self.ranks[0].updates.options(num_returns="streaming").remote()
        try:
            async for ref in stream:
                item = await ref
                if "load" in item:
                    self._last_load = item["load"]
                for update in item["updates"]:
                    queue = self._requests.get(update["request_id"])
                    if queue is not None:
                        queue.put_nowait(update)
            broke: BaseException = RuntimeError("rank 0's update stream ended")
        except ray.exceptions.RayError as exc:
            broke = exc
        logger.error("replica %s: rank 0's update stream broke: %s", self.replica_tag, unwrap(broke))
        for rid, queue in list(self._requests.items()):
            self._abort(rid)
            queue.put_nowait(self._lost(rid, broke))

    async def _parse(self, body: dict[str, Any]) -> tuple[str, list[int], SamplingParams, list[str]]:
        """(request id, prompt token ids, sampling params, stop strings); ValueError names the
        field (an id this replica is running is one). The ingress has validated and tokenized
        already; direct handle callers may send text, tokenized here off the event loop."""
        parsed = parse_request(body, RoutedBody)
        if parsed.stop and self.tokenizer is None:
            raise InvalidRequest("sampling.stop: stop strings need a tokenizer; use stop_token_ids")
        ids = parsed.body.prompt_token_ids
        if ids is None:
            if self.tokenizer is None:
                raise InvalidRequest("prompt: this model has no tokenizer; send prompt_token_ids")
            self.limits.check_text(parsed.body.prompt)
            ids = await asyncio.to_thread(self.tokenizer.encode, parsed.body.prompt)
        rid = parsed.request_id or f"{self.replica_tag}-{next(self._ids)}"
        if rid in self._requests:
            raise InvalidRequest(f"request_id: {rid!r} is already in use")
        return rid, list(ids), parsed.sampling, parsed.stop

    async def abort(self, rid: str) -> None:
        await self.ranks[0].abort.remote(rid)

    async def load(self) -> dict[str, Any]:
        return {"replica": self.replica_tag, **await self.ranks[0].load.remote()}

    async def model_info(self) -> dict[str, Any]:
        return {"replica": self.replica_tag, "tp_size": self.args.tp_size, **self.info}

    async def kv_check(self) -> list[dict[str, int]]:
        """Every rank's pools are back at their initial free counts (raises otherwise)."""
        return await asyncio.gather(*[a.kv_check.remote() for a in self.ranks])

    # -- Serve hooks ---------------------------------------------------------------------------
    async def check_health(self) -> None:
        """Fails when a rank actor died, a rank loop stopped or a step stalled; Serve then
        replaces the replica. A dead or stalled rank leaves the others waiting in a collective
        until its timeout: the replica kills them at once, so that requests in flight end now
        (UNAVAILABLE) rather than when the collective gives up."""
        try:
            await asyncio.wait_for(
                asyncio.gather(*[a.ping.remote() for a in self.ranks]), timeout=self.args.health_check_timeout_s
            )
        except ray.exceptions.RayError as exc:
            logger.error("replica %s: a rank failed (%s); stopping the ranks", self.replica_tag, unwrap(exc))
            for actor in self.ranks:
                ray.kill(actor, no_restart=True)
            raise

    async def record_routing_stats(self) -> dict[str, Any]:
        return await self.load()

    def __del__(self) -> None:
        """Serve drained the replica: stop the rank loops, then make sure the actors are gone."""
        ranks = getattr(self, "ranks", [])
        try:
            ray.get([a.shutdown.remote() for a in ranks], timeout=30)
        except Exception as exc:  # noqa: BLE001 - a dead rank cannot shut down; kill what is left
            logger.warning("replica %s: rank shutdown failed (%s); killing the rank actors", self.replica_tag, exc)
        for actor in ranks:
            ray.kill(actor, no_restart=True)


def _serve_ids() -> tuple[str, str | None]:
    """(application name, this replica's id as the request router knows it); outside Serve
    ("local", None). Rank actors are named slidespec-<app>-<replica>-rank<r>."""
    try:
        from ray import serve

        context = serve.get_replica_context()
        return context.app_name, context.replica_id.unique_id
    except Exception:  # noqa: BLE001 - not running inside a Serve replica
        return "local", None
