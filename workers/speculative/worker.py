"""The speculative decoding step loop (chain drafts, top-k 1).

One decode round for every running request:

    draft DECODE x (num_steps - 1)   drafts 2..k (draft 1 came from the last catch-up)
    TARGET_VERIFY                    the pending token and k drafts, k + 1 query rows each
    accept                           greedy match or rejection sampling; commit n + 1 tokens
    DRAFT_EXTEND_V2                  the draft catches up over the verified window, k + 1 rows
                                     each (rows past the accepted tokens are padding)

Slots of rejected drafts are given back after the catch-up, whose padding rows write there;
SWA windows after it too, since it still reads them.

When every request of the round is greedy, each draft step's argmax stays on the device and
feeds the next step and the verification directly (with CUDA graphs, drafts 2..k run as one
chain graph: one launch, no host work between steps); the round's only device-to-host copy is the
drafts with the target's choices after verification. Drafts with a fixed catch-up window
(standalone, EAGLE) launch the catch-up before that copy is read, from the target's choices and
the accepted counts computed on the device, so the device runs it while the host commits; it
proposes the next round's first drafts on the device too, and under CUDA graphs the next round's
drafts 2..k follow it there (`_draft_ahead`): a chain that starts each request `accepted[i]`
positions on. Its KV writes start at the first draft position the catch-up has not made valid,
inside the window the next catch-up rewrites. Then the next round's verify follows them
(`_verify_ahead`), moved on the device the same way, so the device has a whole round queued
while the host commits this one and never waits for the host's next launch; the next round
starts from its results, and the round's trim keeps the slots it writes. Anything the host
learns at the read that changes the batch (a request finished or failed) discards both.
Sampled rounds draw each draft on the host, since rejection sampling needs every draft's
distribution. Greedy rounds whose only processor is a grammar draft as plain greedy rounds do;
the host reads the drafts while the verify runs and fills the verify's masks meanwhile (each
position after the drafts before it), and the masked argmax feeds the device-side acceptance
count from which the catch-up and the next round's drafts are launched before the read of the
target's choices: two reads a round. Under CUDA graphs the next round's verify is launched ahead
too, its drafts' copy queued before it; once this round is committed the host reads them, fills
the masks of its positions after the committed tokens, and queues the masking and the argmax
behind the verify (`_mask_verified`), so the device verifies while the host commits. With
`Drafter.masked_drafts`, such rounds mask each draft step on the device and take its argmax
there; the host reads each draft, a few bytes, to fill the next step's masks (`_masked_round`:
k + 1 reads a round, no host draw). Nothing of the next such round can be launched before the
read (its first draft's mask follows the bonus token), but once the round is committed its next
first drafts are proposed and the next round's draft step 2 is launched (`_step_ahead`), so the
device runs it while the host does the engine's bookkeeping between rounds; a change of
requests, a plain step or a prefill between them drops it.

How many draft steps a round runs is chosen every decode step (`draft_steps`: the controller,
`workers/speculative/controller.py`; k = num_steps every step unless `speculative.adaptive`).
k = 0 is a plain decode step: the draft falls a token behind (`after_plain` keeps the target's
hidden states its catch-up reads), and catches up on the committed tokens as after a prefill
chunk before the next round (`_resume`), or, if it keeps KV of its own, once it is too far behind
(in an SWA draft pool, as far as admission reserved the window for: `Scheduler.draft_lag_room`;
`lag_tokens` positions over its requests otherwise). A
round of k < num_steps is the same round with fewer drafts, replaying graphs captured for its k
(docs/design.md §6.1).
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from attention import ForwardMode
from attention.batch import upload
from workers.cuda_graphs import PADDING_TOKEN
from workers.forward_batch import ForwardBatch
from workers.hidden_ring import HiddenRing
from workers.logprobs import of_rows
from workers.memory.allocator import expand_ranges
from workers.model_runner import ForwardOutput, ModelRunner
from workers.overlap import InFlight
from workers.processors import at_work, process
from workers.request import Request
from workers.sampler import distribution_logits, draw_each
from workers.sampling_params import SamplingParams
from workers.scheduler import ScheduledBatch, Scheduler
from workers.speculative.accept import verify_greedy, verify_sampling
from workers.speculative.acceptance import AcceptanceModel
from workers.speculative.controller import DraftSteps, FixedDraftSteps, PlainLease, RelayedDraftSteps
from workers.speculative.drafter import Drafter, DraftState, HiddenRows
from workers.speculative.stats import SpecStats

logger = logging.getLogger(__name__)

# Plain decode steps a draft with KV of its own may fall behind before it catches up, in an SWA
# draft pool, at least: admission reserves each request's SWA pages for them (`Scheduler.draft_lag`);
# a request whose prefill chunk reserved more lets the draft fall behind further
# (`Scheduler.draft_lag_room`).
MAX_LAG = 64
# Draft positions (over its requests) a draft with full KV of its own may fall behind, and the
# bytes of target hidden states an EAGLE head keeps meanwhile: they bound its catch-up and that
# memory. No sooner than MAX_LAG steps: one catch-up forward (eager: it is ragged) costs what
# several plain steps do, and plain steps run where speculation does not pay, so it is put off as
# long as the bounds allow (a round catches up first anyway; a request that ends before never
# does). With 8,192 positions and 64 MiB the tiny target's EAGLE head at batch 64 caught up every
# 126 steps: on an H200 its mean plain step was 0.12 ms over plain decoding's, 0.06 ms at the median.
LAG_TOKENS = 32768
HIDDEN_BYTES = 256 << 20
# Positions one catch-up forward reads at most (or a prefill chunk, where that is more): what one
# forward's activations may take, as a prefill chunk's do.
CATCH_UP_TOKENS = 8192


@dataclasses.dataclass
class _Verified:
    """The next round's verify, launched before this round's read. Under grammars its choices
    wait for the masks, filled once this round is committed (`_mask_verified`)."""

    drafts: torch.Tensor  # [B, k] the drafts it verifies
    best: torch.Tensor | None  # [B, k + 1] the target's choices (None: their masks not applied yet)
    hidden: torch.Tensor  # its hidden states, k + 1 rows a request
    logits: torch.Tensor | None = None  # under grammars, until masked (a graph's: valid until its next replay)
    copied: InFlight | None = None  # under grammars, the drafts' copy to the host


@dataclasses.dataclass
class _Ahead:
    """Drafts 2..k of the next round, launched before this round's read, and perhaps its
    verify."""

    reqs: list[Request]
    drafts: torch.Tensor  # [B, k - 1], on the device
    num_tokens: list[int] | None = None  # each request's length once this round has committed
    verified: _Verified | None = None

    def serves(self, reqs: list[Request], k: int) -> bool:
        """Launched for a round of exactly these requests at their current lengths, of k drafts."""
        return self.reqs == reqs and self.num_tokens == [r.num_tokens for r in reqs] and self.drafts.shape[1] == k - 1


@dataclasses.dataclass
class _MaskedAhead:
    """A masked round's first draft with its copy to the host queued, and its draft step 2 (None
    for a round of one draft): launched by the round before once it committed, so the device runs
    them while the host does the engine's bookkeeping between rounds."""

    reqs: list[Request]
    tokens: torch.Tensor  # [B] the first drafts, on the device
    hidden: torch.Tensor  # [B, H] the draft hidden states step 2 read
    first: InFlight  # their copy to the host
    step: ForwardOutput | None  # draft step 2's logits for draft 2 (a graph's: valid until its next replay)
    num_tokens: list[int]  # each request's length when it was launched

    def serves(self, reqs: list[Request], k: int) -> bool:
        """Launched for these requests at their current lengths; step 2 serves any round of k >= 2."""
        return self.reqs == reqs and self.num_tokens == [r.num_tokens for r in reqs] and k > 1

    def restore(self) -> None:
        """Dropped: each request's next draft step reads its hidden state from the copy step 2
        read (a proposal's may be a view of the graph output step 2 rewrote: a draft whose steps
        share one graph)."""
        for req, hidden in zip(self.reqs, self.hidden.unbind(0)):
            req.spec.next_hidden = hidden


class SpecWorker:
    def __init__(self, num_steps: int, target: ModelRunner, drafter: Drafter, scheduler: Scheduler) -> None:
        self.num_steps = num_steps
        self.target = target
        self.drafter = drafter
        self.scheduler = scheduler
        self.last_accept_lengths: dict[str, int] = {}
        self.last_drafts: dict[str, list[int]] = {}
        self._ahead: _Ahead | _MaskedAhead | None = None
        self.rounds_drafted_ahead = 0  # rounds whose drafts 2..k the previous round launched
        self.rounds_verified_ahead = 0  # rounds whose verify the previous round launched
        self.masked_rounds = 0  # greedy rounds under grammars drafted on the device (`_masked_round`)
        self.masked_rounds_ahead = 0  # masked rounds whose draft step 2 the previous round launched
        self.verify_ahead = True  # off: every round launches its own verify (benchmarks compare)
        self.acceptance = AcceptanceModel(num_steps, scheduler.req_to_token.max_requests)
        self.controller: DraftSteps = FixedDraftSteps(num_steps)  # (and `lease`, its plain steps granted ahead)
        self.swa = drafter.runner.pool is not None and drafter.runner.pool.has_swa
        self.max_lag = LAG_TOKENS  # plain steps behind before a catch-up (in an SWA pool: the room, if less)
        self.reserved_lag = MAX_LAG if self.swa else 0  # what admission reserves every request (`Scheduler.draft_lag`)
        self._room = self.reserved_lag if self.swa else LAG_TOKENS  # plain steps the SWA pages reserved hold its window
        # A draft with KV of its own that reads no target hidden states, in pools without
        # sliding windows, holds nothing while it falls behind (its pages are the target's, no
        # window waits for it): it catches up only before its next round, in forwards of at
        # most `catch_up_tokens`, so plain steps where speculation does not pay cost no draft work
        self.catches_up_lazily = (
            drafter.runner.pool is not None and not drafter.reads_hidden and not scheduler.allocator.is_hybrid
        )
        self.lag_tokens = LAG_TOKENS  # draft positions behind, over its requests, before a catch-up
        # Positions one catch-up forward reads: CATCH_UP_TOKENS (not a prefill chunk's: an eager
        # draft forward costs milliseconds of host time at any size), or a prefill chunk where that
        # is more; None: unbounded, as prefill is
        self.catch_up_tokens = max(scheduler.chunk, CATCH_UP_TOKENS) if scheduler.chunk else None
        self._row_bytes = 0  # of the target hidden states kept per position
        self._quiet = 0  # plain steps before the catch-up bounds are checked again (`_quiet_steps`)
        self.ring: HiddenRing | None = None  # with graphs, where plain steps keep an EAGLE head's hidden states
        self.catch_ups = 0  # catch-ups after plain decode steps
        self.drops = 0  # rounds launched ahead and dropped
        # Work that ran besides a decode step's own (the two above): a step in whose time it ran
        # is not its kind's time (read twice a step: a count, not a sum)
        self.disturbances = 0
        # `disturbances` when the last round read its results: what is counted after (a round
        # launched ahead, dropped once the read showed a request finished) runs in the next step's time
        self.disturbances_read = 0
        # Plain decode steps run, those since the draft last caught up (`_lag`), and of those the
        # ones whose target hidden states its catch-up reads: (the step's requests, their hidden
        # states, a row each, or the ring row number of their first). Every running request takes
        # part in every decode step, so a request is as many plain steps behind as were counted
        # since it last caught up (`DraftState.synced`): no per-request work.
        self._plain_count = 0
        self._lag = 0
        self._plain: list[tuple[list[Request], torch.Tensor | int | None]] = []
        self._behind = 0  # draft positions behind since the last catch-up, over its requests
        self._moved = 0  # the plain-step count when some request's draft last moved on
        self._finishes = 0  # the scheduler's count of ended requests at the last plain step
        self._ring_end = 0  # the ring row number after the last plain step's rows

    def add_request(self, req: Request) -> None:
        req.spec = DraftState(SpecStats(self.num_steps))

    def after_extend(self, sb: ScheduledBatch, hidden: torch.Tensor) -> None:
        """The target prefilled a chunk of each request: the draft follows. A masked round's draft
        step launched ahead is dropped first: the draft's catch-up may replay the graph holding its
        logits."""
        if isinstance(self._ahead, _MaskedAhead):
            self._drop_ahead()
        rows: HiddenRows = {}
        start = 0
        for req, n in zip(sb.reqs, sb.q_lens):
            rows[req.rid] = (req.kv_len - n, hidden[start : start + n])
            start += n
        live = [r for r in sb.reqs if not r.finished]
        first = [r.row for r, n in zip(sb.reqs, sb.q_lens) if r in live and r.kv_len == n + r.cached_tokens]
        self.acceptance.start(first)  # the first chunk of these requests: their acceptance counts start afresh
        self.drafter.catch_up(ForwardMode.EXTEND, live, rows)
        for req in live:
            req.spec.synced = self._plain_count
        self._moved = self._plain_count
        self._room, self._quiet = self._lag_room(), 0  # (a request admitted)

    @property
    def controller(self) -> DraftSteps:
        return self._controller

    @controller.setter
    def controller(self, controller: DraftSteps) -> None:
        """Its lease too: the plain steps it granted ahead (one never granted for a controller
        that grants none)."""
        self._controller = controller
        self.lease: PlainLease = getattr(controller, "lease", None) or PlainLease()

    def draft_steps(self, reqs: list[Request]) -> int:
        """How many draft steps a decode step of `reqs` runs (0: a plain decode step), as the
        controller chooses, or a plain step it leased; a round launched ahead is dropped before
        a plain step (its slots given back)."""
        lease = self.lease
        if lease.steps and len(reqs) == lease.batch_size and self._ahead is None:
            lease.steps -= 1
            return 0
        k = self.controller.choose(len(reqs), lambda: self.acceptance.expected_tokens([r.row for r in reqs]))
        if k == 0 and self._ahead is not None:
            self._drop_ahead()
        return k

    def _drop_ahead(self) -> None:
        """Drop a round launched ahead, giving back the slots it borrowed."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return
        self._dropped()
        if isinstance(ahead, _MaskedAhead):
            ahead.restore()
        for req in ahead.reqs:
            if not req.finished:
                self.scheduler.trim(req)

    def _dropped(self) -> None:
        """A round launched ahead was dropped: its work ran besides a step's own."""
        self.drops += 1
        self.disturbances += 1

    def propose_draft_steps(self) -> int | None:
        """Rank 0 of a tensor-parallel group: the draft steps of the group's next decode step,
        chosen for the running requests (the step plan carries them); None unless relayed."""
        if not isinstance(self.controller, RelayedDraftSteps):
            return None
        rows = [r.row for r in self.scheduler.running if r.prefilled]
        return self.controller.propose(max(1, len(rows)), lambda: self.acceptance.expected_tokens(rows))

    def keep_in_ring(self, dtype: torch.dtype) -> HiddenRing | None:
        """The ring where the target's plain decode graphs keep the hidden states of a draft
        that reads every plain step's (EAGLE: `Drafter.hidden_kept` None), made now; None for
        the others. It holds what the catch-up bounds let the draft keep: the lesser of
        LAG_TOKENS rows and HIDDEN_BYTES, and at least MAX_LAG + 4 steps of full batches."""
        if self.drafter.hidden_kept is not None:
            return None
        width = self.target.model.handed_on_size
        batch = self.scheduler.max_running
        rows = max(min(LAG_TOKENS, HIDDEN_BYTES // (width * dtype.itemsize)), (MAX_LAG + 4) * batch)
        self.ring = HiddenRing(rows, width, dtype, self.target.device, slack=batch)
        logger.info("hidden ring: %d rows of %d, %.0f MiB", rows, width, self.ring.buffer.nbytes / 2**20)
        return self.ring

    def hold(self, hidden: torch.Tensor | None) -> torch.Tensor | None:
        """A plain step's target hidden states as its forward returned them (None where its
        graph wrote them into the ring), as the draft keeps them: a graph's static buffer, valid
        until its next replay, copied where its catch-up reads more than the last step's rows,
        before the next replay is launched (an overlapped plain step launches the next one
        before committing this one); the rows themselves otherwise (no replay comes between the
        last plain step and the round that reads them)."""
        kept = self.drafter.hidden_kept
        return hidden.clone() if hidden is not None and kept != 0 and kept != 1 else hidden

    def after_plain(self, reqs: list[Request], hidden: torch.Tensor | None, ring_at: int | None = None) -> None:
        """A plain decode step committed a token for each of `reqs` (`hidden`: the target's
        hidden states, a row each, as `hold` kept them, or None where its graph wrote them into
        the ring from row number `ring_at`): the draft falls a token behind and keeps the rows
        its catch-up reads; a draft with KV of its own catches up once too far behind. The same
        few operations whatever the batch, but for a catch-up and a look at the requests once
        some request has ended."""
        rows = len(reqs)
        if ring_at is not None:  # the rows it took, read by the next catch-up and freed after it
            self._ring_end = ring_at + rows
            if hidden is None:
                hidden = ring_at
        self._plain_count += 1
        self._lag += 1
        self._behind += rows
        if self.scheduler.finishes != self._finishes:  # one ended (in this step or before it)
            self._finishes = self.scheduler.finishes
            for req in reqs:
                if req.finished:  # its plain steps are counted now
                    self.settle(req)
            self._room, self._quiet = self._lag_room(), 0
        kept = self.drafter.hidden_kept
        if kept != 0:
            if kept != 1 and hidden is not None and not self._row_bytes:
                self._row_bytes = (
                    self.ring.row_bytes if isinstance(hidden, int) else hidden.shape[-1] * hidden.element_size()
                )
            self._plain.append((reqs, hidden))
            if kept:
                del self._plain[:-kept]
        if self._quiet:  # no bound can be reached yet
            self._quiet -= 1
        elif self.drafter.runner.pool is not None and not self.catches_up_lazily:
            if self._lag >= min(self.max_lag, self._room) or self._too_far_behind() or self._ring_full():
                self._resume([r for r in reqs if not r.finished])
            else:
                self._quiet = self._quiet_steps()

    def _quiet_steps(self) -> int:
        """Plain steps after this one in which no catch-up bound can be reached (checked again
        after them, or once a request ends or is admitted): the lag grows by one a step, the
        positions behind by at most the running requests, the ring's free rows by at most twice
        them (a step that would wrap skips to row 0)."""
        most = self.scheduler.max_running
        steps = min(self.max_lag, self._room) - self._lag
        steps = min(steps, max(MAX_LAG - self._lag, (self._behind_limit() - self._behind) // most))
        if self.ring is not None:
            steps = min(steps, (self.ring.free - 2 * most) // (2 * most))
        return max(0, steps - 1)

    def _lag_room(self) -> int:
        """Plain steps the draft may fall behind before its SWA window outgrows what admission
        reserved for the running requests (no bound for a draft without SWA layers)."""
        room = self.scheduler.draft_lag_room() if self.swa else None
        return LAG_TOKENS if room is None else room

    def windows_moved(self) -> bool:
        """Whether a step may have moved some request's SWA window where windows wait for the
        draft (`Scheduler.window_from`: from the lesser of the target's and the draft's length):
        only a step in which a draft moved on (a prefill chunk, a catch-up, a round) and the
        plain step after it, whose KV reaches the token that draft stopped at; later plain
        steps leave the window at the draft's length."""
        return self._plain_count - self._moved <= 1

    def _too_far_behind(self) -> bool:
        """Whether the draft positions behind (no sooner than MAX_LAG steps) reach `lag_tokens`
        or hold HIDDEN_BYTES of kept target hidden states."""
        return self._lag >= MAX_LAG and self._behind >= self._behind_limit()

    def _behind_limit(self) -> int:
        """Draft positions behind at which the draft catches up: `lag_tokens`, or fewer where
        their kept target hidden states would pass HIDDEN_BYTES."""
        return min(self.lag_tokens, HIDDEN_BYTES // self._row_bytes) if self._row_bytes else self.lag_tokens

    def _ring_full(self) -> bool:
        """Whether the ring may not hold the next plain step's rows (the step in flight took
        its own; a step that would wrap skips to row 0): the rows kept so far are read first."""
        return self.ring is not None and self.ring.free < 2 * self.scheduler.max_running

    def settle(self, req: Request) -> None:
        """Count the plain steps a request took part in since it last caught up, as it catches up
        or once it has ended (an engine aborting a request settles it first)."""
        state = req.spec
        if state.synced is None:
            return
        state.stats.plain_steps += self._plain_count - state.synced
        state.synced = None if req.finished else self._plain_count

    def _resume(self, reqs: list[Request]) -> None:
        """Catch the draft up on the tokens plain decode steps committed since it last proposed
        (`Drafter.catch_up`, as after a prefill chunk), which proposes each request's next
        first draft."""
        behind = [r for r in reqs if not r.finished and r.spec.synced < self._plain_count]  # (all decoding)
        if behind:
            rows = self._plain_hidden(behind) if self.drafter.reads_hidden else {}
            todo = behind
            while todo:  # forwards of at most catch_up_tokens
                self.drafter.catch_up(ForwardMode.EXTEND, todo, rows, self.catch_up_tokens)
                todo = [r for r in todo if not r.finished and r.spec.draft_len < self.drafter.goal(r)]
            for req in behind:
                self.settle(req)
            self.catch_ups += 1
            self.disturbances += 1
        self._plain, self._behind, self._lag, self._quiet = [], 0, 0, 0
        if self.ring is not None:  # the rows the catch-up read
            self.ring.release(self._ring_end)
        self._moved = self._plain_count  # (a round's drafts move on after it too)

    def _kept_rows(self) -> tuple[torch.Tensor, np.ndarray]:
        """The kept plain steps' hidden states as one tensor and each step's first row in it:
        the ring itself when every step's rows are ring rows (kept as their first row number)."""
        kept = [hidden for _, hidden in self._plain]
        if self.ring is not None and all(isinstance(h, int) for h in kept):
            return self.ring.buffer, np.array(kept, dtype=np.int64) % self.ring.capacity
        kept = [self.ring.view(h, len(step)) if isinstance(h, int) else h for step, h in self._plain]
        return torch.cat(kept), np.cumsum([0] + [h.shape[0] for h in kept])

    def _plain_hidden(self, reqs: list[Request]) -> HiddenRows:
        """Each request's target hidden states of positions [first, kv_len): from the first its
        catch-up reads (`Drafter.hidden_from`), the rows of the last plain steps (one a step, each
        a position further on); one gather. Consecutive steps of the same requests share one row
        map, and each such run's picks for every request are a few array operations, not a
        lookup a request and step. Steps kept in the ring are gathered from it in place; others
        from their concatenation."""
        every, bases = self._kept_rows()
        runs: list[list] = []  # [first step, end step, the step's requests]
        for s, (step, _) in enumerate(self._plain):
            if runs and runs[-1][2] == step:  # (the same requests in the same order: identity)
                runs[-1][1] = s + 1
            else:
                runs.append([s, s + 1, step])
        firsts = np.array([self.drafter.hidden_from(r) for r in reqs], dtype=np.int64)
        since = len(self._plain) - (np.array([r.kv_len for r in reqs], dtype=np.int64) - firsts)  # step of `first`
        owners, picks = [], []
        for start, end, step in runs:
            index = {id(r): i for i, r in enumerate(step)}
            row = np.array([index.get(id(r), -1) for r in reqs], dtype=np.int64)  # its row in the run's steps
            low = np.maximum(start, since)
            high = np.maximum(end, low)
            if ((high > low) & (row < 0)).any():
                raise RuntimeError("draft catch-up: a request behind since a plain step it took no part in")
            of, steps = expand_ranges(low, high)  # each request's steps of the run it reads
            owners.append(of)
            picks.append(bases[steps] + row[of])
        order = np.argsort(np.concatenate(owners), kind="stable")  # each request's rows together, in step order
        rows = every.index_select(0, upload(np.concatenate(picks)[order], every.device))
        out, start = {}, 0
        for req, first in zip(reqs, firsts.tolist()):
            n = req.kv_len - first
            out[req.rid], start = (first, rows[start : start + n]), start + n
        return out

    def decode_round(self, reqs: list[Request], k: int) -> list[tuple[Request, list[int]]]:
        """One round of `k` draft steps for every request; a request whose sampling or
        verification raises fails alone (`Scheduler.fail`) and leaves the round. When every
        request is greedy, drafts stay on the device until verification, and the round reads
        the device once."""
        self._resume(reqs)
        reqs = [r for r in reqs if not r.finished]  # (a catch-up's draw may fail one)
        if not reqs:
            return []
        ahead, self._ahead = self._ahead, None
        if ahead is not None and not ahead.serves(reqs, k):
            if isinstance(ahead, _MaskedAhead):
                ahead.restore()
            ahead = None
            self._dropped()
        logits = chosen = None  # the verify's, and its rows' distributions, where the host may read them
        masked = None  # a masked round's drafts on the device
        free = None  # the device drafts of a round whose grammars mask only its verify
        proposal = None  # a masked round's next first drafts, proposed once the round is committed
        if isinstance(ahead, _Ahead) and ahead.verified is not None and ahead.verified.best is not None:
            # verified already: straight to acceptance
            self.rounds_drafted_ahead += 1
            self.rounds_verified_ahead += 1
            drafts, best, hidden = ahead.verified.drafts, ahead.verified.best, ahead.verified.hidden
            draft_probs = [[None] * k for _ in reqs]
        else:
            greedy = all(r.sampling.greedy and not at_work(r, grammar=False) for r in reqs)
            grammars = any(r.grammar is not None for r in reqs)
            if greedy and not (grammars and self.drafter.masked_drafts):
                drafted = ahead if isinstance(ahead, _Ahead) else None
                reqs, drafts, draft_probs = self._draft_on_device(reqs, drafted, k)
                # the verify's grammar masks follow the drafts: their copy, queued before the
                # verify, is read while it runs
                copied = InFlight.of(reqs, drafts) if grammars else None
                out = self._verify(reqs, drafts, k)
                if copied is not None:
                    free, drafts = drafts, copied.read()
            elif greedy:
                stepped = ahead if isinstance(ahead, _MaskedAhead) else None
                out, drafts, masked = self._masked_round(reqs, k, stepped)
                draft_probs = [[None] * k for _ in reqs]
            else:
                reqs, drafts, draft_probs = self._draft_on_host(reqs, k)
                if not reqs:
                    return []
                out = self._verify(reqs, drafts, k)
            logits, hidden = out.logits, out.hidden
            # rows of grammar-only greedy requests that read no logits: masked in place (the draft
            # steps' masks at depths 0..k-1), no copy of the verify's logits
            in_place = (masked is not None or free is not None) and not any(r.sampling.reads_logits for r in reqs)
            host_drafts = None if isinstance(drafts, torch.Tensor) else drafts
            processed, params = self._processed(reqs, k, logits, host_drafts, in_place)
            chosen = distribution_logits(processed, params)
            best = processed.argmax(dim=-1).view(len(reqs), k + 1)

        starts = [r.num_tokens - 1 for r in reqs]  # the pending token's position
        on_device = isinstance(drafts, torch.Tensor)
        early = False  # the draft's catch-up launched before the read
        if on_device or free is not None:  # the round's one copy of the target's choices (and drafts)
            device_drafts = drafts if on_device else free
            flight = InFlight.of(reqs, torch.cat([drafts, best], dim=1) if on_device else best)
            accepted = (device_drafts == best[:, :k]).to(torch.int64).cumprod(dim=1).sum(dim=1)
            if self.drafter.fixed_window:  # the draft catches up, and drafts the next round, meanwhile
                self.drafter.catch_up_verified(reqs, starts, accepted, k + 1, hidden, tokens=best.flatten())
            self._ahead = self._draft_ahead(reqs, accepted, best, hidden)
            early = self.drafter.fixed_window or self._ahead is not None  # a frozen-KV chain ahead is its catch-up
            if self._ahead is not None:
                self._ahead.verified = self._verify_ahead(reqs, accepted, best, self._ahead.drafts)
            if on_device:
                both = flight.read()
                drafts, best = [row[:k] for row in both], [row[k:] for row in both]
            else:
                best = flight.read()
        else:  # one device-to-host copy of the target's choices
            flight = InFlight.of(reqs, best)
            if masked is not None and self.drafter.fixed_window:  # the catch-up runs while the host commits
                accepted = (masked == best[:, :k]).to(torch.int64).cumprod(dim=1).sum(dim=1)
                proposal = self.drafter.catch_up_verified(
                    reqs, starts, accepted, k + 1, hidden, tokens=best.flatten(), propose=False
                )
                early = True
            best = flight.read()
        self.disturbances_read = self.disturbances

        events, live, judged = [], [], []
        self.last_accept_lengths = {}
        self.last_drafts = {r.rid: d for r, d in zip(reqs, drafts)}
        for i, (req, start, d, dp) in enumerate(zip(reqs, starts, drafts, draft_probs)):
            rows, row = slice(i * (k + 1), (i + 1) * (k + 1)), req.row
            try:
                new = self._accept(req, start, d, dp, None if logits is None else logits[rows], chosen, rows, best[i])
            except Exception as exc:  # noqa: BLE001 - this request fails alone
                self.scheduler.fail(req, exc)
                continue
            events.append((req, new))
            judged.append((row, self.last_accept_lengths[req.rid] - 1))
            if not req.finished:
                live.append((i, req, start, len(new) - 1))
        if judged:
            self.acceptance.record([row for row, _ in judged], k, [n for _, n in judged])
        self._logprobs(events, reqs, chosen, k)
        if self._ahead is not None and len(live) < len(reqs):  # good for a round of exactly these requests
            self._ahead = None
            self._dropped()
        if live:
            _, live_reqs, live_starts, accepted = map(list, zip(*live))
            if early:
                self.drafter.settle_verified(live_reqs, live_starts, accepted)
                if proposal is not None:  # its first drafts masked after the committed tokens
                    self.drafter.propose(reqs, proposal)
            else:
                if len(live) < len(reqs):
                    hidden = torch.cat([hidden[i * (k + 1) : (i + 1) * (k + 1)] for i, _, _, _ in live])
                self.drafter.catch_up_verified(live_reqs, live_starts, accepted, k + 1, hidden)
            if self._ahead is not None and any(r.finished for r in reqs):  # (a failed proposal ends one)
                self._ahead = None
                self._dropped()
            # rejected drafts' slots, written by the catch-up's padding rows; those the next
            # round's verify writes stay while it is in flight
            keep = k if self._ahead is not None and self._ahead.verified is not None else 0
            for req in live_reqs:
                if not req.finished:
                    self.scheduler.trim(req, keep)
        if self._ahead is not None:
            self._ahead.num_tokens = [r.num_tokens for r in reqs]
            if self._ahead.verified is not None and self._ahead.verified.best is None:
                self._mask_verified(self._ahead, k)
        elif masked is not None:  # the next round's first draft step runs while the engine's bookkeeping does
            self._ahead = self._step_ahead([r for r in reqs if not r.finished], k)
        return events

    def _verify_batch(
        self,
        reqs: list[Request],
        k: int,
        starts: list[int],
        input_ids: list[list[int]],
        allocate_to: list[int] | None = None,
    ) -> ForwardBatch:
        """A verify of k + 1 positions from each request's `starts` (slots allocated up to
        `allocate_to`, by default those positions)."""
        return ForwardBatch.build(
            ForwardMode.TARGET_VERIFY,
            rows=[r.row for r in reqs],
            prefix_lens=starts,
            input_ids=input_ids,
            out_cache_loc=self.scheduler.slots(reqs, starts, [s + k + 1 for s in starts], allocate_to),
            req_to_token=self.scheduler.req_to_token,
            logits_rows=range(len(reqs) * (k + 1)),
        )

    def _verify(self, reqs: list[Request], drafts: torch.Tensor | list[list[int]], k: int) -> ForwardOutput:
        """The target over each request's pending token and its k drafts (on the device or the host)."""
        starts = [r.num_tokens - 1 for r in reqs]  # the pending token's position
        on_device = isinstance(drafts, torch.Tensor)
        batch = self._verify_batch(
            reqs,
            k,
            starts,
            [r.tokens(s, s + 1) + ([PADDING_TOKEN] * k if on_device else d) for r, s, d in zip(reqs, starts, drafts)],
        )
        if on_device:
            pending = batch.input_ids.view(len(reqs), k + 1)[:, :1]
            batch.use_device_ids(torch.cat([pending, drafts], dim=1).flatten())
        return self.target.forward(batch)

    def _verify_ahead(
        self, reqs: list[Request], accepted: torch.Tensor, best: torch.Tensor, drafts_ahead: torch.Tensor
    ) -> _Verified | None:
        """The next round's verify, launched before this round's read, after the drafts it
        checks: each request's bonus token `best[i, accepted[i]]`, the catch-up's first draft
        and drafts 2..k, all on the device; staged as if nothing were accepted and moved on by
        `accepted` on the device. None (the next round verifies) without a graph for it, when a
        request may read its logits, or without room for the furthest outcome."""
        k = best.shape[1] - 1
        if not self.verify_ahead or any(r.sampling.reads_logits for r in reqs):
            return None
        firsts = [r.num_tokens for r in reqs]  # the next pending token's position, nothing accepted
        ends = [f + 2 * k + 1 for f in firsts]  # the furthest outcome: k accepted, k + 1 positions on
        if not self.scheduler.has_room_ahead(reqs, ends):
            return None
        batch = self._verify_batch(reqs, k, firsts, [[PADDING_TOKEN] * (k + 1)] * len(reqs), ends)
        bonus = best.gather(1, accepted[:, None])
        drafts = torch.cat([torch.stack([r.spec.next_token for r in reqs])[:, None], drafts_ahead], dim=1)
        batch.use_device_ids(torch.cat([bonus, drafts], dim=1).flatten())
        # under grammars the masks follow the drafts: their copy, queued before the verify
        copied = InFlight.of(reqs, drafts) if any(r.grammar is not None for r in reqs) else None
        out = self.target.forward_ahead(batch, accepted, k)
        if out is None:
            return None
        if copied is not None:
            return _Verified(drafts, None, out.hidden, out.logits, copied)
        return _Verified(drafts, out.logits.argmax(dim=-1).view(len(reqs), k + 1), out.hidden)

    def _mask_verified(self, ahead: _Ahead, k: int) -> None:
        """The choices of a verify launched ahead under grammars, once this round is committed:
        each position's mask after the committed tokens and the drafts before it (the host reads
        the drafts while the verify runs), applied to its logits in place, then their argmax, all
        queued before the next round replays the verify's graph."""
        verified, reqs = ahead.verified, ahead.reqs
        processed, _ = self._processed(reqs, k, verified.logits, verified.copied.read(), in_place=True)
        verified.best = processed.argmax(dim=-1).view(len(reqs), k + 1)
        verified.logits = verified.copied = None

    def _processed(
        self, reqs: list[Request], k: int, logits: torch.Tensor, drafts: list[list[int]] | None, in_place: bool
    ) -> tuple[torch.Tensor, list[SamplingParams]]:
        """A verify's logits processed (and each row's sampling parameters): position j of a
        request as plain decoding would process it there, after the pending token and drafts
        1..j (`drafts` on the host; None: the rows need no prefixes)."""
        params = [r.sampling for r in reqs for _ in range(k + 1)]
        prefixes = None if drafts is None else [d[:j] for d in drafts for j in range(k + 1)]
        history = self.scheduler.history([r for r in reqs for _ in range(k + 1)], prefixes)
        return process(logits, params, history, in_place), params

    def _draft_ahead(
        self, reqs: list[Request], accepted: torch.Tensor, best: torch.Tensor, hidden: torch.Tensor
    ) -> _Ahead | None:
        """The next round's drafts 2..k, launched before this round's read (`Drafter.draft_ahead`)."""
        if best.shape[1] < 3:  # k < 2: no drafts 2..k
            return None
        drafts = self.drafter.draft_ahead(reqs, accepted, best, hidden)
        return None if drafts is None else _Ahead(reqs, drafts)

    def _draft_on_device(
        self, reqs: list[Request], ahead: _Ahead | None, k: int
    ) -> tuple[list[Request], torch.Tensor, list[list[None]]]:
        """Greedy drafts 1..k as a device tensor `[B, k]`: each step's argmax feeds the next
        (drafts 2..k: `ahead`'s, when the round before launched them for these requests)."""
        tokens, hidden = _first_drafts(reqs)
        no_probs = [[None] * k for _ in reqs]
        if ahead is not None:
            self.rounds_drafted_ahead += 1
            return reqs, torch.cat([tokens[:, None], ahead.drafts], dim=1), no_probs
        if k > 1:
            chained = self.drafter.chain(reqs, tokens, hidden, k - 1)
            if chained is not None:  # drafts 2..k in one graph replay
                return reqs, torch.cat([tokens[:, None], chained[0]], dim=1), no_probs
        drafts = [tokens]
        for j in range(2, k + 1):
            out = self.drafter.step(reqs, j, drafts[-1], hidden)
            drafts.append(self.drafter.greedy(out.logits, out.ids))
            hidden = out.hidden
        return reqs, torch.stack(drafts, dim=1), no_probs

    def _first_step(self, reqs: list[Request], step: bool) -> _MaskedAhead:
        """A masked round's first draft, its copy to the host queued behind it, and (`step`) its
        draft step 2, whose logits the host masks once it has read the first draft."""
        tokens, hidden = _first_drafts(reqs)
        first = InFlight.of(reqs, tokens)
        out = self.drafter.step(reqs, 2, tokens, hidden) if step else None
        return _MaskedAhead(reqs, tokens, hidden, first, out, [r.num_tokens for r in reqs])

    def _step_ahead(self, reqs: list[Request], k: int) -> _MaskedAhead | None:
        """The next masked round's first draft step, launched once this round is committed and its
        first drafts proposed (masked after the committed tokens): None for rounds of one draft
        (the next is likely alike) or without room for the slot it writes."""
        if (
            k < 2
            or not reqs
            or not self.scheduler.has_room_ahead(reqs, [r.num_tokens + 1 - self.drafter.shift for r in reqs])
        ):
            return None
        return self._first_step(reqs, step=True)

    def _masked_round(
        self, reqs: list[Request], k: int, ahead: _MaskedAhead | None = None
    ) -> tuple[ForwardOutput, list[list[int]], torch.Tensor]:
        """Greedy drafts of requests whose only processor is their grammar, and their verify:
        each draft step's logits masked on the device after the drafts before it, then its argmax
        there. The host reads each draft (one small copy a step, queued behind its argmax and read
        once the next step is launched) to advance the matchers and fill the next step's masks,
        the last while the verify runs: k reads, and the verify's a (k + 1)-th. The verify's
        masks at depths 0..k-1 are the draft steps'. `ahead`: the first draft and draft step 2,
        launched by the round before. Returns the verify and the drafts, on the host and on the
        device `[B, k]`."""
        self.masked_rounds += 1
        if ahead is None:
            ahead = self._first_step(reqs, step=k > 1)
        else:
            self.masked_rounds_ahead += 1
        on_device, drafts = [ahead.tokens], [[] for _ in reqs]
        flight, out = ahead.first, ahead.step
        for j in range(2, k + 1):  # draft step j is in flight
            for d, t in zip(drafts, flight.read()):
                d.append(t)
            history = self.scheduler.history(reqs, drafts, self.drafter.partial_vocab)
            on_device.append(self.drafter.greedy_masked(out.logits, out.ids, history))
            flight = InFlight.of(reqs, on_device[-1])
            if j < k:
                out = self.drafter.step(reqs, j + 1, on_device[-1], out.hidden)
        stacked = torch.stack(on_device, dim=1)
        out = self._verify(reqs, stacked, k)
        for d, t in zip(drafts, flight.read()):
            d.append(t)
        return out, drafts, stacked

    def _draft_on_host(
        self, reqs: list[Request], k: int
    ) -> tuple[list[Request], list[list[int]], list[list[torch.Tensor | None]]]:
        """Drafts drawn on the host, step by step, each through the processor stage as the target
        will process its position (after the drafts before it); a request whose draw raises
        fails alone."""
        drafts = [[int(r.spec.next_token)] for r in reqs]
        draft_probs = [[r.spec.next_probs] for r in reqs]
        hidden = torch.stack([r.spec.next_hidden for r in reqs])
        for j in range(2, k + 1):
            out = self.drafter.step(reqs, j, [d[-1] for d in drafts], hidden)
            logits = self.drafter.target_logits(out.logits, out.ids)
            history = self.scheduler.history(reqs, [list(d) for d in drafts], self.drafter.partial_vocab)
            drawn, errors = draw_each(logits, [r.sampling for r in reqs], [r.generator for r in reqs], history)
            for d, dp, t, p in zip(drafts, draft_probs, drawn.tokens, drawn.probs):
                d.append(t)
                dp.append(p)
            hidden = out.hidden
            if errors:
                for i, exc in errors.items():
                    self.scheduler.fail(reqs[i], exc)
                keep = [i for i in range(len(reqs)) if i not in errors]
                reqs, drafts, draft_probs = (
                    [reqs[i] for i in keep],
                    [drafts[i] for i in keep],
                    [draft_probs[i] for i in keep],
                )
                hidden = hidden[keep]
        return reqs, drafts, draft_probs

    def _accept(
        self,
        req: Request,
        start: int,
        drafts: list[int],
        draft_probs: list[torch.Tensor | None],
        logits: torch.Tensor | None,
        chosen: torch.Tensor | None,
        rows: slice,
        best: list[int],
    ) -> list[int]:
        """Verify one request's drafts, commit the accepted tokens and the bonus; its new tokens
        (`logits`: the verify's raw rows of this request, `chosen[rows]` their distributions'
        logits after the processor stage; None where a round verified ahead of the host, which
        only greedy requests that read no logits do; `best`: the processed argmax of each row)."""
        if req.sampling.greedy:
            accepted, bonus = verify_greedy(best, drafts)
        else:
            target_probs = torch.softmax(chosen[rows], dim=-1)
            accepted, bonus = verify_sampling(target_probs, torch.stack(draft_probs), drafts, req.generator)
        req.spec.stats.record(accepted, len(drafts))
        self.last_accept_lengths[req.rid] = accepted + 1
        new = self.scheduler.commit(req, drafts[:accepted] + [bonus], start + accepted + 1)
        if req.sampling.return_logits:  # a copy: graphs rewrite their rows
            req.logits.extend(logits[: len(new)].to("cpu", copy=True))
        return new

    def _logprobs(
        self, events: list[tuple[Request, list[int]]], reqs: list[Request], chosen: torch.Tensor | None, k: int
    ) -> None:
        """The logprobs of each committed token that a request asked for, from the target's
        distribution at its position (the verify's processed rows: never the draft's), read to
        the host in one copy for the round."""
        asking = [(req, new) for req, new in events if req.logprobs is not None and new]
        if not asking:
            return
        index = {id(r): i for i, r in enumerate(reqs)}
        picks = [index[id(req)] * (k + 1) + j for req, new in asking for j in range(len(new))]
        ks = [req.sampling.logprobs for req, new in asking for _ in new]
        got = of_rows(chosen[picks], [t for _, new in asking for t in new], ks)
        start = 0
        for req, new in asking:
            req.logprobs.extend(got.part(start, start + len(new)))
            start += len(new)


def _first_drafts(reqs: list[Request]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's first draft (on the device) and the draft hidden state its next step reads."""
    first = [r.spec.next_token for r in reqs]
    if all(isinstance(t, torch.Tensor) for t in first):
        tokens = torch.stack(first)
    else:  # proposed by a sampled batch: on the host
        tokens = upload(np.array([int(t) for t in first], dtype=np.int64), reqs[0].spec.next_hidden.device)
    return tokens, torch.stack([r.spec.next_hidden for r in reqs])
