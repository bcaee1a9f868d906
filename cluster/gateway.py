"""What both front doors (gRPC and HTTP) do with a generation request, in one place.

`prepare` checks sizes, validates every field and tokenizes text off the event loop, so a
malformed or oversized request is answered at once and never reaches the router. `generate`
streams a prepared request from the engine deployment: request ids are unique among live
requests on both doors, a replica failure before the first token is retried on another
replica, and every failure ends as a `RequestFailed` carrying its error code; nothing that
failed because of its own content is retried. `abort` asks the engine that holds a request to
end it, so the stream still ends with the request's own last update and usage.

Each stream closes the one it reads (`aclosing`) before it ends itself: a request's id is free
again only after everything below it (the replica's queue for that id, an abort it owes rank 0)
has been let go, so a new request that reuses the id never meets the old one's leftovers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import ray
from ray.serve.exceptions import BackPressureError, RequestCancelledError

from cluster.metrics import ServingMetrics
from cluster.protocol import InvalidRequest, PromptLimits, RoutedBody, check_sizes, parse_request
from cluster.rank_actor import rank_actor_name
from cluster.rank_client import unwrap
from cluster.replica_set import QueueFull, ReplicaSet
from cluster.routing.load_board import BOARD
from cluster.routing.serve_router import route_request
from cluster.telemetry import RequestTelemetry
from workers.error_codes import ErrorCode
from workers.sampling_params import choice_seed

logger = logging.getLogger(__name__)

RESOURCE_EXHAUSTED = "resource_exhausted"  # the engine deployment's queue is full
# error code -> (gRPC status, HTTP status) on the two doors
STATUS = {
    ErrorCode.INVALID_ARGUMENT.value: (grpc.StatusCode.INVALID_ARGUMENT, 400),
    ErrorCode.INTERNAL.value: (grpc.StatusCode.INTERNAL, 500),
    ErrorCode.UNAVAILABLE.value: (grpc.StatusCode.UNAVAILABLE, 503),
    RESOURCE_EXHAUSTED: (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
}
LONG_PROMPT_CHARS = 4096  # texts longer than this are tokenized on a worker thread
READY_POLL_S = 0.25  # how often a request waiting for an engine replica looks again


class RequestFailed(Exception):
    """A request that ended without finishing; `code` is an `ErrorCode` value or RESOURCE_EXHAUSTED."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Gateway:
    def __init__(
        self,
        llm,
        app_name: str,
        tokenizer,
        limits: PromptLimits,
        ready: Callable[[], Awaitable[bool]],
        retries: int,
        retry_backoff_s: float,
        metrics: ServingMetrics | None = None,
        ready_wait_s: float = 0.0,
        replicas: ReplicaSet | None = None,
    ) -> None:
        """`replicas`: stream to the replicas' rank-0 actors directly (`cluster/replica_set.py`);
        None: through the engine deployment's Serve handle `llm`."""
        self.llm = llm
        self.replicas = replicas
        self.metrics = metrics
        self.app_name = app_name
        self.tokenizer = tokenizer
        self.limits = limits
        self.ready = ready
        self.retries = retries
        self.retry_backoff_s = retry_backoff_s
        self.ready_wait_s = ready_wait_s
        self.was_ready = False  # an engine replica has run: a gap is a redeploy or a replacement
        self._calls: dict[str, Any] = {}  # live request id -> its Serve call (None before it is sent)
        self._aborted: set[str] = set()
        self._groups: dict[str, list[str]] = {}  # a live request of n choices -> its choices' ids
        self._placed: dict[str, asyncio.Event] = {}  # choice 0 of n -> set once it has a replica
        self.retried = 0  # attempts repeated on another replica

    # -- before routing -------------------------------------------------------------------------
    async def prepare(self, body: Any, door: str) -> dict[str, Any]:
        """The dict the engine deployment gets: validated, tokenized, with a request id.
        InvalidRequest names the field; a rejection is logged (no traceback) and counted."""
        try:
            return await self._prepare(body)
        except InvalidRequest as exc:
            self.rejected(door, exc)
            raise

    def rejected(self, door: str, exc: Exception) -> None:
        """Bad input is the client's business: logged without a traceback, and counted."""
        logger.info("rejected a %s request: %s", door, exc)
        self.ended(ErrorCode.INVALID_ARGUMENT.value)

    def ended(self, reason: str) -> None:
        """Count a request that ended before it had telemetry of its own."""
        if self.metrics is not None:
            self.metrics.ended(reason)

    async def _prepare(self, body: Any) -> dict[str, Any]:
        if isinstance(body, dict):
            check_sizes(body, self.limits)
        parsed = parse_request(body)
        if parsed.stop and self.tokenizer is None:
            raise InvalidRequest("sampling.stop: stop strings need a tokenizer; use stop_token_ids")
        ids = parsed.body.prompt_token_ids
        if ids is None:
            if self.tokenizer is None:
                raise InvalidRequest("prompt: this model has no tokenizer; send prompt_token_ids")
            prompt = parsed.body.prompt
            ids = (
                self.tokenizer.encode(prompt)
                if len(prompt) <= LONG_PROMPT_CHARS
                else await asyncio.to_thread(self.tokenizer.encode, prompt)
            )
        if not ids:
            raise InvalidRequest("prompt_token_ids: empty prompt")
        self.limits.check_ids(len(ids), "prompt" if parsed.body.prompt is not None else "prompt_token_ids")
        routed = {
            "request_id": parsed.request_id or uuid.uuid4().hex,
            "prompt_token_ids": ids,
            "sampling": parsed.body.sampling.model_dump(exclude_defaults=True),
            "stream": parsed.body.stream,
        }
        if parsed.body.session_id:
            routed["session_id"] = parsed.body.session_id
        return routed

    # -- streaming -------------------------------------------------------------------------------
    async def generate(self, routed: dict[str, Any], telemetry: RequestTelemetry) -> AsyncIterator[dict[str, Any]]:
        """The request's updates; the last of each choice is finished (`index` names the choice
        when `sampling.n` > 1: each is its own request, `choices`). Raises RequestFailed; the
        first choice to fail ends the others."""
        group = choices(routed)
        if len(group) == 1:
            async with contextlib.aclosing(self._generate(routed, telemetry)) as updates:
                async for update in updates:
                    yield update
            return
        ids = [choice["request_id"] for choice in group]
        if any(rid in self._calls for rid in ids):
            raise RequestFailed(ErrorCode.INVALID_ARGUMENT.value, f"request_id: {ids[0]!r} is already in use")
        self._groups[ids[0]] = ids
        self._placed[ids[0]] = asyncio.Event()
        try:
            streams = [self._generate(choice, telemetry) for choice in group]
            async with contextlib.aclosing(merge_streams(streams)) as merged:
                async for index, update in merged:
                    yield {**update, "index": index}
        finally:
            self._groups.pop(ids[0], None)
            self._placed.pop(ids[0], None)

    async def _generate(self, routed: dict[str, Any], telemetry: RequestTelemetry) -> AsyncIterator[dict[str, Any]]:
        """One request's updates, retried on another replica when one fails before its first token."""
        rid = routed["request_id"]
        if rid in self._calls:
            raise RequestFailed(ErrorCode.INVALID_ARGUMENT.value, f"request_id: {rid!r} is already in use")
        self._calls[rid] = None
        sent = 0
        try:
            for attempt in range(self.retries + 1):
                try:
                    async with contextlib.aclosing(self._attempt(routed)) as updates:
                        async for update in updates:
                            telemetry.update(update)
                            sent += 1
                            yield update
                    return
                except RequestFailed as failed:
                    retryable = sent == 0 and attempt < self.retries  # the client has seen nothing yet
                    if not (failed.code == ErrorCode.UNAVAILABLE.value and retryable):
                        raise
                    self._before_retry(routed, failed.message)
                await asyncio.sleep(self.retry_backoff_s * 2**attempt)
        finally:
            self._calls.pop(rid, None)
            self._aborted.discard(rid)

    async def _attempt(self, routed: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        rid = routed["request_id"]
        if not await self._wait_ready():
            raise RequestFailed(ErrorCode.UNAVAILABLE.value, "no healthy replica of the engine deployment")
        if rid in self._aborted:
            yield _aborted(rid)
            return
        attempt = self._direct(routed) if self.replicas is not None else self._through_serve(routed)
        async with contextlib.aclosing(attempt) as updates:
            async for update in updates:
                yield update

    async def _direct(self, routed: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """One attempt on the replica the policy chooses, streamed from its rank 0. A choice that
        follows another (`choices`) is routed once that one has its replica, to the same one
        where it may, and submitted after it."""
        rid = routed["request_id"]
        parsed = parse_request(routed, RoutedBody)
        request = route_request(routed)
        placed = self._placed.get(parsed.body.follows or "")
        if placed is not None:
            await placed.wait()
        try:
            client = await self.replicas.acquire(request)
        except QueueFull as exc:
            raise RequestFailed(RESOURCE_EXHAUSTED, str(exc)) from None
        except LookupError as exc:
            raise RequestFailed(ErrorCode.UNAVAILABLE.value, str(exc)) from None
        finally:
            if rid in self._placed:
                self._placed[rid].set()
        try:
            if rid in self._aborted:
                yield _aborted(rid)
                return
            ids = parsed.body.prompt_token_ids
            trace = routed.get("trace_context")
            stream = client.generate(rid, ids, parsed.sampling, parsed.stop, trace, parsed.body.follows)
            async with contextlib.aclosing(stream) as updates:
                async for update in updates:
                    if update["finished"]:
                        BOARD.finished(rid, update.get("load"))
                    error = update.get("error")
                    if error is not None:
                        if error["code"] == ErrorCode.UNAVAILABLE.value:
                            self.replicas.set_replica_aside(client.replica)
                        raise RequestFailed(error["code"], error["message"])
                    yield update
        finally:
            BOARD.finished(rid)
            self.replicas.release()

    async def _through_serve(self, routed: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """One attempt through the engine deployment's Serve handle (its request router chooses)."""
        rid = routed["request_id"]
        call = self.llm.options(stream=True).generate.remote(routed)
        self._calls[rid] = call
        try:
            async for update in call:
                if update["finished"]:
                    BOARD.finished(rid, update.get("load"))
                error = update.get("error")
                if error is not None:
                    raise RequestFailed(error["code"], error["message"])
                yield update
        except (asyncio.CancelledError, RequestCancelledError):
            call.cancel()
            if rid in self._aborted:  # aborted before a replica took it: end the stream normally
                yield _aborted(rid)
                return
            raise
        except GeneratorExit:  # the consumer closed the stream (a client that left): stop generating
            call.cancel()
            raise
        except RequestFailed:
            raise
        except Exception as exc:  # noqa: BLE001 - Serve and Ray failures: classified here
            raise RequestFailed(*_classify(exc)) from None

    async def _wait_ready(self) -> bool:
        """Whether an engine replica runs. Once one has run, a request waits up to `ready_wait_s`
        for the next (Serve stops an old replica before its successor runs), so a redeploy or a
        replacement fails nothing; a deployment that never ran fails at once."""
        deadline = asyncio.get_running_loop().time() + (self.ready_wait_s if self.was_ready else 0.0)
        while not await self.ready():
            if asyncio.get_running_loop().time() >= deadline:
                return False
            await asyncio.sleep(READY_POLL_S)
        self.was_ready = True
        return True

    def _before_retry(self, routed: dict[str, Any], message: str) -> None:
        decision = BOARD.pop_decision(routed["request_id"])
        if decision is not None:  # try another replica than the one that failed
            routed["exclude_replicas"] = sorted({*routed.get("exclude_replicas", ()), decision[2]})
        self.retried += 1
        logger.warning("request %s failed before its first token (%s); retrying", routed["request_id"], message)

    # -- control ---------------------------------------------------------------------------------
    async def abort(self, rid: str) -> bool:
        """End a live request. The replica holding it aborts it in its engine, so the stream ends
        with its own last update (finish reason "abort", the usage it consumed); a request not
        yet on a replica is cancelled. A request of n choices ends every choice."""
        group = self._groups.get(rid)
        if group is not None:
            return any([await self.abort(choice) for choice in group if choice != rid] + [await self._abort(rid)])
        return await self._abort(rid)

    async def _abort(self, rid: str) -> bool:
        if rid not in self._calls:
            return False
        replica = BOARD.replica_of(rid)
        if replica is not None:
            try:
                actor = ray.get_actor(rank_actor_name(self.app_name, replica, 0))
                await actor.abort.remote(rid)
                return True
            except Exception as exc:  # noqa: BLE001 - the replica went away: cancel instead
                logger.info("abort %s: replica %s unreachable (%s); cancelling", rid, replica, exc)
        call = self._calls.get(rid)
        self._aborted.add(rid)
        if call is not None:
            call.cancel()
        return True


def choices(routed: dict[str, Any]) -> list[dict[str, Any]]:
    """A prepared request of `sampling.n` choices as one request per choice, as vLLM forks one:
    ids `rid`, `rid-1`, ...; seeds `seed + i` when a seed is given (wrapped to 64 bits), each
    drawn by the replica otherwise; only choice 0 asks for the prompt's logprobs (the same for
    every choice). The others follow choice 0: its replica prefills the prompt once and forks
    it (`Engine.add_request`'s `follows`)."""
    sampling = {k: v for k, v in routed.get("sampling", {}).items() if k != "n"}
    n = routed.get("sampling", {}).get("n", 1)
    if n == 1:
        return [{**routed, "sampling": sampling}]
    rid, out = routed["request_id"], []
    for i in range(n):
        own = dict(sampling)
        if "seed" in own:
            own["seed"] = choice_seed(own["seed"], i)
        choice = {**routed, "request_id": rid, "sampling": own}
        if i:
            own.pop("prompt_logprobs", None)
            choice.update(request_id=f"{rid}-{i}", follows=rid)
        out.append(choice)
    return out


async def merge_streams(streams: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """(stream index, item) from every stream as they come; the first failure ends all (each
    stream is closed however the merge ends)."""
    if len(streams) == 1:
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[Any]) -> None:
        try:
            async for item in stream:
                await queue.put((index, item, None, False))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((index, None, exc, True))
        else:
            await queue.put((index, None, None, True))
        finally:
            await stream.aclose()

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        done = 0
        while done < len(tasks):
            index, item, error, ended = await queue.get()
            if error is not None:
                raise error
            if ended:
                done += 1
                continue
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _aborted(rid: str) -> dict[str, Any]:
    """The last update of a request aborted before a replica took it."""
    return {"request_id": rid, "token_ids": [], "finished": True, "finish_reason": "abort"}


def _classify(exc: BaseException) -> tuple[str, str]:
    cause = unwrap(exc)
    if isinstance(exc, BackPressureError) or isinstance(cause, BackPressureError):
        return RESOURCE_EXHAUSTED, "the engine deployment's request queue is full; retry later"
    if isinstance(cause, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)):
        return ErrorCode.UNAVAILABLE.value, f"a replica failed: {cause}"
    return ErrorCode.INTERNAL.value, f"{type(cause).__name__}: {cause}"
