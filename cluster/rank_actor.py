"""One tensor-parallel rank as a Ray actor: a thin host around `workers.rank_loop.RankLoop`.

The actor builds its rank's `Engine` (target and draft shards, KV pools, the replica's allocator
state), joins the replica's `torch.distributed` group (rank 0 publishes address and port) and
runs the rank loop in a thread. Rank 0 also takes requests and aborts and hands out their
updates, once per step, to each caller (a "reader": the replica, an ingress): over its Unix
socket (`cluster/rank_channel.py`) for callers on this node, which the loop thread writes
itself, or through one Ray streaming generator per reader (`submit`, `updates`); other ranks only
follow rank 0's broadcasts.

The replica deployment creates rank actors from this class and the ingress reads rank names and
updates with its helpers: torch and the engine load only in the actor's own process (`__init__`,
`setup`), which keeps seconds of imports out of every process that merely talks to ranks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
import os
import socket
import threading
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import ray

from cluster.config import TracingArgs
from cluster.rank_channel import ChannelServer, Connection
from cluster.tracing import context_from_carrier, engine_info, flush_all, record_step, tracer_for
from workers.error_codes import ErrorCode
from workers.sampling_params import SamplingParams
from workers.startup import show_progress_logs
from workers.step_record import StepRecord

if TYPE_CHECKING:
    from workers.rank_loop import RankLoop, Update

logger = logging.getLogger(__name__)

HAND_OVER_WAIT_S = 0.002  # at most this long the loop thread waits for a step's updates to go out
REPLICA_READER = "replica"  # the replica deployment's own stream (Serve handle callers)
DRAIN_POLL_S = 0.05


Sink = str | Connection  # where a request's updates go: a Ray reader's name or a socket caller


@dataclasses.dataclass
class Outbox:
    """One Ray reader's updates since its stream's last item: request id -> its joined update."""

    updates: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    load: dict[str, Any] | None = None  # rank 0's load as of the latest step that finished a request
    ready: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)  # the current stream's wake-up
    stream: int = 0  # the `updates()` call reading it; a newer call ends an older one


def rank_actor_name(app: str, replica: str, rank: int) -> str:
    """The Ray name of a replica's rank actor (the ingress reaches rank 0 by it)."""
    return f"slidespec-{app}-{replica}-rank{rank}"


def rank0_replica(app: str, name: str) -> str | None:
    """The replica whose rank-0 actor has this Ray name in this application, if any (Serve's
    replica ids have no dashes, so another application's longer name cannot match)."""
    prefix, suffix = f"slidespec-{app}-", "-rank0"
    replica = name[len(prefix) : -len(suffix)] if name.startswith(prefix) and name.endswith(suffix) else ""
    return replica if replica and "-" not in replica else None


def update_to_wire(update: Update) -> dict[str, Any]:
    """A rank loop update as the plain dict that crosses process boundaries."""
    out: dict[str, Any] = {"token_ids": update.token_ids, "finished": update.finished}
    out["cached_tokens"] = update.output.cached_tokens if update.output is not None else update.cached_tokens
    if update.phases is not None:
        out["queue_s"], out["prefill_s"] = update.phases
    if update.error is not None:
        out["error"] = {"code": update.code.value, "message": update.error}
    for field in ("logprobs", "prompt_logprobs"):
        if getattr(update, field) is not None:
            out[field] = dataclasses.asdict(getattr(update, field))
    if update.output is not None:
        o = update.output
        out.update(
            finish_reason=o.finish_reason,
            prompt_tokens=len(o.prompt_token_ids),
            completion_tokens=len(o.token_ids),
            queue_s=o.queue_s,
            prefill_s=o.prefill_s,
        )
        if o.spec is not None:
            out["spec"] = {
                "verify_steps": o.spec.verify_steps,
                "accept_lengths": o.spec.accept_lengths,
                "accepted_per_position": o.spec.accepted_per_position,
                "mean_accept_length": o.spec.mean_accept_length,
                "draft_steps": o.spec.draft_steps,
                "plain_steps": o.spec.plain_steps,
            }
    return out


def join_updates(earlier: dict[str, Any], later: dict[str, Any]) -> dict[str, Any]:
    """Two consecutive updates of a request as one: their tokens (and their logprobs) joined,
    the later one's fields, and the fields only the earlier one had (the first token's
    `queue_s`, `prefill_s` and prompt logprobs)."""
    joined = {**earlier, **later, "token_ids": earlier["token_ids"] + later["token_ids"]}
    if "logprobs" in earlier and "logprobs" in later:
        joined["logprobs"] = {k: earlier["logprobs"][k] + later["logprobs"][k] for k in earlier["logprobs"]}
    return joined


def error_update(code: ErrorCode, message: str) -> dict[str, Any]:
    """The last update of a request that ended with an error before or without tokens."""
    return {"token_ids": [], "finished": True, "error": {"code": code.value, "message": message}}


class RankActor:
    def __init__(
        self,
        rank: int,
        tp_size: int,
        engine_kwargs: dict[str, Any],
        torch_threads: int = 1,
        control_timeout_s: float = 600.0,
        tracing: dict[str, Any] | None = None,
        stall_timeout_s: float = 300.0,
    ) -> None:
        import torch

        show_progress_logs()  # start-up phases reach the driver's terminal (`slidespec serve`)
        self.rank = rank
        self.tp_size = tp_size
        self.engine_kwargs = engine_kwargs
        self.control_timeout_s = control_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.tracer = tracer_for(TracingArgs(**(tracing or {})), f"rank{rank}") if rank == 0 else None
        self._trace_contexts: dict[str, Any] = {}  # request id -> its request span's context
        torch.set_num_threads(torch_threads)
        self.loop: RankLoop | None = None
        self._thread: threading.Thread | None = None
        self._aio: asyncio.AbstractEventLoop | None = None
        self._outboxes: dict[str, Outbox] = {}  # Ray reader -> what its stream has not taken yet
        self._reader_of: dict[str, Sink | None] = {}  # live request id -> where its updates go (None: gone)
        self._claims = threading.Lock()  # request ids are claimed from the event loop and socket threads
        self._sent = threading.Event()  # a stream took the last hand-over
        self.channel: ChannelServer | None = None
        self.draining = False

    def address(self) -> tuple[str, int]:
        """This node's address and a free port for the process group's rendezvous (rank 0)."""
        host = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((host, 0))
            return host, s.getsockname()[1]

    async def setup(self, master_addr: str, master_port: int) -> dict[str, Any]:
        """Join the replica's process group, build this rank's engine, start the rank loop."""
        import torch.distributed as dist

        from workers.distributed import SINGLE_RANK, TPGroup
        from workers.engine import Engine
        from workers.rank_loop import RankLoop

        self._aio = asyncio.get_running_loop()
        device = self.engine_kwargs.get("device", "cpu")
        timeout = datetime.timedelta(seconds=self.control_timeout_s)
        control, tp = None, SINGLE_RANK  # one rank: no process group, so no rendezvous port either
        if self.tp_size > 1:
            dist.init_process_group(
                "nccl" if device == "cuda" else "gloo",
                init_method=f"tcp://{master_addr}:{master_port}",
                rank=self.rank,
                world_size=self.tp_size,
                timeout=timeout,
            )
            control = dist.new_group(backend="gloo", timeout=timeout) if device == "cuda" else dist.group.WORLD
            tp = TPGroup(self.rank, self.tp_size, dist.group.WORLD)
        engine = Engine(**self.engine_kwargs, tp=tp)
        self.engine_info = engine_info(engine)
        self.num_steps = engine.spec.num_steps if engine.spec else 0
        self.loop = RankLoop(
            engine,
            self.rank,
            control,
            self._on_updates,
            on_step=self._on_step if self.tracer is not None else None,
        )
        self._thread = threading.Thread(target=self.loop.run, name=f"rank{self.rank}-loop", daemon=True)
        self._thread.start()
        if self.rank == 0:
            try:
                self.channel = ChannelServer(self._on_channel_message, self._on_channel_close)
            except OSError as exc:  # e.g. no writable temporary directory: callers take Ray
                logger.warning("rank 0: no Unix socket for same-node callers (%s); they stream through Ray", exc)
        cfg = engine.cfg
        return {
            "rank": self.rank,
            "architecture": cfg.architecture,
            "vocab_size": cfg.vocab_size,
            "context_length": engine.context_length,
            **self.engine_info,
            "kv": engine.kv_stats(),
        }

    # -- rank 0 ----------------------------------------------------------------------------------
    def channel_address(self) -> dict[str, Any] | None:
        """Where callers on this node reach rank 0 without Ray: the node, the socket's path and
        its secret (None on other ranks)."""
        if self.channel is None:
            return None
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "path": self.channel.path,
            "secret": self.channel.secret,
        }

    def submit(
        self,
        rid: str,
        prompt_ids: list[int],
        sampling: dict[str, Any],
        trace_context: dict[str, str] | None = None,
        reader: Sink = REPLICA_READER,
        follows: str | None = None,
    ) -> dict[str, Any] | None:
        """Queue a request; its updates go to `reader` (a Ray reader's `updates` stream, or a
        socket caller). Returns None, or the error update of a request that cannot run (invalid
        input is not a fault of this actor, so it is answered, never raised; a draining replica
        answers UNAVAILABLE, which callers retry elsewhere). `trace_context`: the W3C carrier of
        the request's span; step spans join that trace. `follows`: another choice of the same
        prompt, submitted before (`Engine.add_request`)."""
        if self.draining:
            return error_update(ErrorCode.UNAVAILABLE, f"rank {self.rank} is draining (the replica is stopping)")
        with self._claims:  # before the loop can report it: the loop thread routes by this
            if rid in self._reader_of:
                return error_update(ErrorCode.INVALID_ARGUMENT, f"request_id: {rid!r} is already in use")
            self._reader_of[rid] = reader
        if self.tracer is not None and trace_context:
            self._trace_contexts[rid] = context_from_carrier(trace_context)
        try:
            self.loop.submit(rid, prompt_ids, SamplingParams(**sampling), follows)
        except (ValueError, TypeError, RuntimeError) as exc:  # RuntimeError: the loop stopped
            self._reader_of.pop(rid, None)
            self._trace_contexts.pop(rid, None)
            code = ErrorCode.UNAVAILABLE if isinstance(exc, RuntimeError) else ErrorCode.INVALID_ARGUMENT
            return error_update(code, str(exc))
        return None

    def _on_channel_message(self, conn: Connection, message: tuple) -> None:
        """A socket caller's submit (refusals answered on its connection) or abort."""
        kind, *args = message
        if kind == "submit":
            rid, prompt_ids, sampling, trace_context, *follows = args  # follows: n choices' (`submit`)
            refused = self.submit(rid, prompt_ids, sampling, trace_context, conn, *follows)
            if refused is not None:
                conn.send({"updates": [{"request_id": rid, **refused}]})
        elif kind == "abort":
            self.loop.abort(args[0])
        else:
            logger.warning("rank 0 channel: caller %s sent an unknown message %r", conn.reader, kind)

    def _on_channel_close(self, conn: Connection) -> None:
        """A socket caller left: nobody reads its requests' tokens, abort them."""
        self._abort_requests_of(conn)

    async def updates(self, reader: str = REPLICA_READER) -> AsyncIterator[dict[str, Any]]:
        """The updates of every request submitted for `reader`, as one stream (the reader hands
        them out): each item is everything that happened since the previous one, one update per
        request (consecutive steps' updates joined: `join_updates`), so the number of items follows the
        steps, not steps x requests, and shrinks further while this actor's event loop is behind.
        An item with a finished request carries this rank's load. One stream per reader: opening
        it again ends the previous one; a stream that ends with its reader gone (its consumer
        closed it, not a newer stream) aborts that reader's requests."""
        box = self._outboxes.setdefault(reader, Outbox())
        older, box.ready = box.ready, asyncio.Event()
        box.stream += 1
        mine, wake = box.stream, box.ready
        older.set()  # an older stream of this reader wakes up and ends
        if box.updates:
            wake.set()
        replaced = False
        try:
            while True:
                await wake.wait()
                wake.clear()
                if box.stream != mine:
                    replaced = True
                    return
                if not box.updates:
                    continue
                item = {"updates": list(box.updates.values())}
                if box.load is not None:
                    item["load"] = box.load
                box.updates, box.load = {}, None
                yield item
                self._sent.set()  # Ray has taken the item
        finally:
            if not replaced and reader != REPLICA_READER:
                self._forget_reader(reader)

    def _forget_reader(self, reader: str) -> None:
        """A reader left: abort its requests (nobody reads their tokens) and drop its outbox."""
        self._outboxes.pop(reader, None)
        self._abort_requests_of(reader)

    def _abort_requests_of(self, sink: Sink) -> None:
        """Abort a gone sink's requests; their last updates (the aborts') go nowhere."""
        with self._claims:  # the loop thread pops finished requests under it: none comes back
            gone = [rid for rid, to in self._reader_of.items() if to == sink]  # a Connection equals itself only
            for rid in gone:
                self._reader_of[rid] = None
        for rid in gone:
            self.loop.abort(rid)

    async def drain(self, timeout_s: float) -> int:
        """Refuse new requests and wait up to `timeout_s` for the running ones to finish (the
        replica is stopping; callers that reach rank 0 directly are not tracked by Serve's own
        graceful shutdown). Returns how many are still running."""
        self.draining = True
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self.loop.in_flight and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        return self.loop.in_flight

    def abort(self, rid: str) -> None:
        self.loop.abort(rid)

    def load(self) -> dict[str, Any]:
        """Running and waiting requests and KV use, live (read without stopping the loop)."""
        return self.loop.load()

    def _on_step(self, step: StepRecord) -> None:
        """Called by the loop thread after every step: its span, in its requests' traces."""
        contexts = [self._trace_contexts.get(rid) for rid in step.request_ids]
        record_step(self.tracer, step, contexts, self.engine_info, self.loop.engine.kv_stats(), self.num_steps)

    def _on_updates(self, updates: list[Update]) -> None:
        """Called by the loop thread once per step: each sink's updates as one item (with rank
        0's load when one of them finished a request). Socket callers' items are written here;
        Ray readers' go to the event loop in one hand-over, then, while the device runs the next
        (overlapped) step or is this host's CPU, a short wait (the interpreter lock released)
        until the stream has taken it. Otherwise the event loop would wait for the lock at every
        step of the hand-over while this thread runs the next step's Python: up to the 5 ms
        switch interval each time, on every token's way out. A GPU without a step in flight
        (speculative rounds, prefill) would idle through the wait: none then."""
        items: dict[Sink, dict[str, Any]] = {}
        load = None  # rank 0's load, read once a step (when a request finished)
        for update in updates:
            if update.finished:
                with self._claims:
                    sink = self._reader_of.pop(update.rid, None)
                self._trace_contexts.pop(update.rid, None)
            else:
                sink = self._reader_of.get(update.rid)
            if sink is None:  # its reader left (and aborted it): nobody reads these
                continue
            item = items.setdefault(sink, {"updates": []})
            item["updates"].append({"request_id": update.rid, **update_to_wire(update)})
            if update.finished:
                item["load"] = load = load or self.load()
        for_ray = {}
        for sink, item in items.items():
            if isinstance(sink, Connection):
                sink.send(item)
            else:
                for_ray[sink] = item
        if for_ray:
            self._sent.clear()
            self._aio.call_soon_threadsafe(self._collect, for_ray)
            if self.loop.engine.host_can_pause:
                self._sent.wait(HAND_OVER_WAIT_S)

    def _collect(self, items: dict[str, dict[str, Any]]) -> None:
        """Add a step's items to their Ray readers' outboxes, joining each request's tokens with
        what is waiting there (a finished update is a request's last)."""
        for reader, item in items.items():
            box = self._outboxes.setdefault(reader, Outbox())
            for wire in item["updates"]:
                waiting = box.updates.get(wire["request_id"])
                box.updates[wire["request_id"]] = wire if waiting is None else join_updates(waiting, wire)
            if "load" in item:
                box.load = item["load"]
            box.ready.set()

    # -- every rank ------------------------------------------------------------------------------
    def ping(self) -> dict[str, Any]:
        """Raise if this rank's loop has stopped or a step has run longer than `stall_timeout_s`
        (a stall: a kernel or collective that never returns); otherwise its step count, the Ray
        node and process it runs in and the readers connected to its socket."""
        if self.loop is None:
            raise RuntimeError(f"rank {self.rank}: not set up")
        if self.loop.error is not None or not self._thread.is_alive():
            raise RuntimeError(f"rank {self.rank}: rank loop stopped: {self.loop.error}")
        stalled = self.loop.step_running_for()
        if stalled > self.stall_timeout_s:
            raise RuntimeError(
                f"rank {self.rank}: a step has run for {stalled:.1f} s (stall_timeout_s {self.stall_timeout_s})"
            )
        return {
            "rank": self.rank,
            "steps": self.loop.steps,
            "draining": self.draining,
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
            "socket_callers": sorted(c.reader for c in self.channel.connections) if self.channel else [],
        }

    def kv_check(self) -> dict[str, int]:
        """Assert this rank's pools are back at their initial free counts; returns them."""
        self.loop.engine.check_no_leak()
        return self.loop.engine.kv_stats()

    def shutdown(self) -> None:
        """Stop the loop (rank 0 broadcasts the stop to the others) and leave the group."""
        import torch.distributed as dist

        if self.loop is not None and self.rank == 0:
            self.loop.stop()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self.channel is not None:
            self.channel.close()
        flush_all()
        if dist.is_initialized():
            if self.loop is not None and self.loop.error is None:
                dist.barrier(group=self.loop.group)  # no rank closes connections another still reads
            dist.destroy_process_group()
