"""The scheduler loop of one tensor-parallel rank, in lockstep with the other ranks.

Every rank holds an `Engine` built with the same arguments (its own shard of the target and
draft, its own KV pools, the same allocator state). Rank 0 decides each step: it collects the
requests that arrived and the aborts, and broadcasts them as a `StepPlan` over a CPU process
group; every rank applies the plan and runs `Engine.step()`, whose collectives (all-reduce,
all-gather of logits) keep the ranks together. Sampling is identical on every rank (same logits,
same per-request seeds, fixed by rank 0), so the allocators never drift apart. With adaptive draft
lengths the plan also carries the draft steps of the next decode step, as rank 0's controller
chose them (each rank's timings differ). Per-step control is one broadcast; no remote procedure
calls.

Runs under `torch.distributed` alone (benchmarks) or inside Ray rank actors (serving).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from workers.engine import Engine, RequestOutput
from workers.error_codes import ErrorCode
from workers.grammar import Compilation, StructuredOutputs
from workers.logprobs import Logprobs
from workers.sampling_params import SamplingParams
from workers.step_record import StepRecord

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class NewRequest:
    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams  # with an explicit seed
    follows: str | None = None  # another choice of the same prompt (`Engine.add_request`)


@dataclasses.dataclass
class StepPlan:
    new: list[NewRequest] = dataclasses.field(default_factory=list)
    aborts: list[str] = dataclasses.field(default_factory=list)
    # structured outputs rank 0 started compiling: the other ranks start too, so that theirs are
    # ready (or nearly) when rank 0's request joins a later plan
    grammars: list[StructuredOutputs] = dataclasses.field(default_factory=list)
    flush_cache: bool = False  # drop the prefix cache's unused pages, on every rank at once
    stop: bool = False
    draft_steps: int | None = None  # of the next decode step, rank 0's choice (adaptive speculation)

    @property
    def changes(self) -> bool:
        return bool(self.new or self.aborts or self.grammars or self.flush_cache or self.stop)


@dataclasses.dataclass(frozen=True)
class Update:
    """What rank 0 reports for a request after a step."""

    rid: str
    token_ids: list[int]  # new tokens
    finished: bool
    output: RequestOutput | None = None  # the final record, when finished
    error: str | None = None  # the request cannot finish, and why
    code: ErrorCode | None = None  # with `error`
    cached_tokens: int = 0  # its prompt tokens the prefix cache held
    phases: tuple[float | None, float | None] | None = None  # (queue, prefill) s, with its first token
    logprobs: Logprobs | None = None  # of `token_ids`, when the request asks for logprobs
    prompt_logprobs: Logprobs | None = None  # with its first token, when it asks for its prompt's


class RankLoop:
    def __init__(
        self,
        engine: Engine,
        rank: int,
        group: dist.ProcessGroup | None = None,
        on_updates: Callable[[list[Update]], None] | None = None,
        idle_wait_s: float = 0.5,
        on_step: Callable[[StepRecord], None] | None = None,
    ) -> None:
        """`group`: the CPU (gloo) group the plan is broadcast over; None when alone.
        `on_updates` (rank 0) gets the updates of every request a step (or a plan) touched, in one
        call: one hand-over per step, however many requests run; `on_step` (rank 0) every step's
        record."""
        self.engine = engine
        self.rank = rank
        self.group = group
        self.on_updates = on_updates or (lambda updates: None)
        self.on_step = on_step
        self.idle_wait_s = idle_wait_s
        self._inbox: queue.Queue[tuple[str, object]] = queue.Queue()
        self._lock = threading.Lock()
        self._in_flight: set[str] = set()
        self._rng = random.Random()
        # rank 0's requests whose structured outputs compile off the loop: they join a plan when ready
        self._compiling: dict[str, tuple[NewRequest, Compilation]] = {}
        self._compiled: dict[str, object] = {}  # their compiled grammars, for `_apply`
        self.steps = 0
        self._step_started: float | None = None  # monotonic time the step under way began
        self.error: BaseException | None = None

    # -- rank 0, from any thread ------------------------------------------------------------
    def submit(self, rid: str, prompt_ids: list[int], sampling: SamplingParams, follows: str | None = None) -> None:
        """Queue a request for the next step; raise ValueError (naming the field) if it could
        never run or its id is in use. `follows`: see `Engine.add_request`."""
        if self.error is not None:
            raise RuntimeError(f"rank loop stopped: {self.error}")
        self.engine.check_request(prompt_ids, sampling)
        with self._lock:
            if rid in self._in_flight:
                raise ValueError(f"request_id: {rid!r} is already in use")
            self._in_flight.add(rid)
        if sampling.seed is None:
            sampling = dataclasses.replace(sampling, seed=self._rng.getrandbits(63))
        grammar = self.engine.start_grammar(sampling)
        if grammar is not None:  # the loop takes it when compiled: wake it then
            grammar.future.add_done_callback(lambda _: self._inbox.put(("compiled", None)))
        self._inbox.put(("new", (NewRequest(rid, list(prompt_ids), sampling, follows), grammar)))

    def abort(self, rid: str) -> None:
        self._inbox.put(("abort", rid))

    def flush_cache(self) -> None:
        """Drop the prefix cache's pages no running request uses, before the next step."""
        self._inbox.put(("flush", None))

    def stop(self) -> None:
        self._inbox.put(("stop", None))

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._in_flight)

    def load(self) -> dict[str, Any]:
        """Live counts for routing and `GetLoad`: requests running and waiting (queued here or in
        the scheduler), KV pages in use, token load and mean accept length of running requests.
        Read from another thread without stopping the loop; a stopped loop runs nothing."""
        kv = self.engine.kv_stats()
        running = [] if self.error is not None else list(self.engine.scheduler.running)
        lengths = [n for r in running if r.spec is not None for n in r.spec.stats.accept_lengths]
        return {
            "running": len(running),
            "waiting": 0 if self.error is not None else max(0, self.in_flight - len(running)),
            "kv_full_used": kv["full_total"] - kv["full_free"],
            "kv_full_total": kv["full_total"],
            "kv_swa_used": kv["swa_total"] - kv["swa_free"],
            "kv_swa_total": kv["swa_total"],
            "token_load": sum(r.num_tokens for r in running),
            "mean_accept_length": sum(lengths) / len(lengths) if lengths else 0.0,
        }

    # -- every rank ----------------------------------------------------------------------------
    def run(self) -> None:
        """Step until a plan says stop. On failure (a rank died, a kernel faulted), every request
        in flight gets an error update and the exception is kept in `self.error`."""
        try:
            while True:
                plan = self._broadcast(self._lead_plan() if self.rank == 0 else None)
                self._apply(plan)
                if plan.stop:
                    self._fail_all("the engine shut down")
                    return
                if self.engine.has_unfinished():
                    self._step()
        except BaseException as exc:  # noqa: BLE001 - reported to every waiting request
            self.error = exc
            logger.exception("rank %d: loop stopped", self.rank)
            self._fail_all(f"{type(exc).__name__}: {exc}")
            if not isinstance(exc, Exception):
                raise

    def _next_plan(self) -> StepPlan:
        plan = StepPlan()
        block = not self.engine.has_unfinished()
        while True:
            try:
                kind, item = self._inbox.get(block=block, timeout=self.idle_wait_s if block else None)
            except queue.Empty:
                break  # idle: an empty plan keeps the other ranks' broadcast alive
            block = False
            if kind == "new":  # an earlier abort of its id was for a request that has ended
                new, grammar = item
                plan.aborts = [rid for rid in plan.aborts if rid != new.rid]
                if grammar is None:
                    plan.new.append(new)
                else:
                    self._compiling[new.rid] = (new, grammar)
                    plan.grammars.append(grammar.spec)
            elif kind == "abort":
                if item in self._compiling:  # never reached the engine
                    new, _ = self._compiling.pop(item)
                    output = RequestOutput(item, new.prompt_ids, [], "abort")
                    self._hand_over([self._end(Update(item, [], True, output))])
                else:
                    plan.aborts.append(item)
            elif kind == "flush":
                plan.flush_cache = True
            elif kind == "stop":
                plan.stop = True
                return plan
        self._take_compiled(plan)
        return plan

    def _take_compiled(self, plan: StepPlan) -> None:
        """Requests whose grammar is ready join the plan; one that failed to compile, or not
        within its time bound, ends with INVALID_ARGUMENT and never reaches the engine."""
        for rid, (new, grammar) in list(self._compiling.items()):
            if not grammar.ready:
                continue
            del self._compiling[rid]
            try:
                self._compiled[rid] = grammar.result()
            except ValueError as exc:
                self._hand_over([self._end(Update(rid, [], True, error=str(exc), code=ErrorCode.INVALID_ARGUMENT))])
                continue
            plan.new.append(new)

    def _lead_plan(self) -> StepPlan:
        """Rank 0's plan, with the draft steps its controller chose for the next decode step
        where the group relays them."""
        plan = self._next_plan()
        if self.group is not None and self.engine.spec is not None:
            plan.draft_steps = self.engine.spec.propose_draft_steps()
        return plan

    def _broadcast(self, plan: StepPlan | None) -> StepPlan:
        """Rank 0's plan on every rank: one small broadcast when nothing changed (most steps:
        whether it did, and the draft steps), the pickled plan after it otherwise."""
        if self.group is None:
            return plan
        src = dist.get_global_rank(self.group, 0)
        steps = -1 if plan is None or plan.draft_steps is None else plan.draft_steps
        head = torch.tensor([int(plan is not None and plan.changes), steps], dtype=torch.int32)
        dist.broadcast(head, src=src, group=self.group)
        changed, steps = head.tolist()
        if changed:
            box = [plan]
            dist.broadcast_object_list(box, src=src, group=self.group)
            plan = box[0]
        else:
            plan = StepPlan()
        plan.draft_steps = None if steps < 0 else steps
        return plan

    def _apply(self, plan: StepPlan) -> None:
        """Admit and abort as rank 0 decided. A request that cannot be admitted fails alone."""
        updates = []
        if self.rank != 0:
            for spec in plan.grammars:
                self.engine.start_grammar(SamplingParams(structured_outputs=spec), bounded=False)
        for new in plan.new:
            try:
                grammar = self._compiled.pop(new.rid, None)
                self.engine.add_request(
                    new.prompt_ids, new.sampling, request_id=new.rid, grammar=grammar, follows=new.follows
                )
            except Exception as exc:  # noqa: BLE001 - the same on every rank: this request fails
                code = ErrorCode.INVALID_ARGUMENT if isinstance(exc, ValueError) else ErrorCode.INTERNAL
                updates.append(self._end(Update(new.rid, [], True, error=_describe(exc), code=code)))
        for rid in plan.aborts:
            if self.engine.abort(rid):
                updates.append(self._finish(rid, []))
        if plan.flush_cache:
            self.engine.flush_cache()
        if plan.draft_steps is not None:
            self.engine.spec.controller.k = plan.draft_steps
        self._hand_over(updates)

    def step_running_for(self) -> float:
        """Seconds the step under way has run (0 between steps): what a stall watchdog reads."""
        started = self._step_started
        return 0.0 if started is None else time.monotonic() - started

    def _step(self) -> None:
        self._step_started = time.monotonic()
        try:
            events = self.engine.step()
        finally:
            self._step_started = None
        self.steps += 1
        if self.rank == 0 and self.on_step is not None:
            self._report(self.on_step, self.engine.last_step)
        hits = dict(zip(self.engine.last_step.request_ids, self.engine.last_step.cached_tokens))
        self._hand_over(
            [
                self._finish(rid, tokens)
                if finished
                else Update(
                    rid,
                    tokens,
                    False,
                    cached_tokens=hits.get(rid, 0),
                    phases=self.engine.first_token_phases(rid, tokens),
                    **self._logprobs(rid, tokens),
                )
                for rid, tokens, finished in events
            ]
        )

    def _logprobs(self, rid: str, tokens: list[int]) -> dict[str, Logprobs]:
        """The update's logprob fields, where the request asks for them (none: no fields)."""
        own, prompt = self.engine.step_logprobs(rid, tokens)
        fields = {"logprobs": own, "prompt_logprobs": prompt}
        return {k: v for k, v in fields.items() if v is not None}

    def _finish(self, rid: str, tokens: list[int]) -> Update:
        """A finished request's last update (its KV released); building it fails only this
        request."""
        try:
            output = self.engine.output(rid)
            logprobs = self._logprobs(rid, tokens)
        except Exception as exc:  # noqa: BLE001 - e.g. detokenizing its output raised
            logger.warning("request %s: building its output failed: %s", rid, _describe(exc))
            update = Update(rid, tokens, True, error=_describe(exc), code=ErrorCode.INTERNAL)
        else:
            update = (
                Update(rid, tokens, True, output, error=output.error, code=ErrorCode.INTERNAL, **logprobs)
                if output.error is not None
                else Update(rid, tokens, True, output, **logprobs)
            )
        self.engine.release(rid)
        return self._end(update)

    def _end(self, update: Update) -> Update:
        with self._lock:
            self._in_flight.discard(update.rid)
        return update

    def _hand_over(self, updates: list[Update]) -> None:
        if self.rank == 0 and updates:
            self._report(self.on_updates, updates)

    def _report(self, callback: Callable, item: object) -> None:
        """A failing callback (a closed stream, a broken exporter) must not stop the loop."""
        try:
            callback(item)
        except Exception:  # noqa: BLE001 - logged; the loop goes on
            logger.exception("rank %d: reporting %s failed", self.rank, type(item).__name__)

    def _fail_all(self, message: str) -> None:
        """Every request submitted and not finished (queued or running) ends with an error and,
        where the engine still can, gives its KV back."""
        with self._lock:
            rids, self._in_flight = sorted(self._in_flight), set()
        self._compiling.clear()
        self._compiled.clear()
        for rid in rids:
            try:
                self.engine.abort(rid)
                self.engine.release(rid)
            except Exception:  # noqa: BLE001 - the engine may be broken; the requests end anyway
                logger.warning("rank %d: could not free request %s", self.rank, rid)
        self._hand_over([Update(rid, [], True, error=message, code=ErrorCode.UNAVAILABLE) for rid in rids])


def _describe(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
