"""How many draft steps each decode step runs: speculation that never loses (docs/design.md §6.1).

Speculation pays only while the tokens a round adds outrun what the round costs beyond a plain
step, and that balance moves with the batch size, the text and the model. Every decode step the
adaptive controller picks k in 0..num_steps for the batch (0: a plain decode step, the draft
catching up later) maximising expected tokens per second: the acceptance model's expected tokens
for k (`acceptance.py`) over the cost model's seconds for k at this batch size
(`cost_model.py`). Against flapping it keeps a choice for at least `dwell` steps and leaves it
only for one expected to be `margin` faster; it decides every `dwell` steps (a decision's host
time is paid once in that many), and at plain steps after `plain_dwell` steps unless the batch
size changed, then twice as long after each decision there that kept them, up to
`max_plain_dwell` steps, and never past a probe's due step: no plain step judges a draft, so
between them what the acceptance model expects stays as it was for the same requests, and a
decision there (tens of microseconds of host time, a few percent of a host-bound plain step when
paid every few steps, about 1% every 32) mostly finds what the last one found. Changing between
plain steps and rounds costs more than either kind's steps (the pipeline drained and restarted,
the draft's catch-up, a round launched ahead and dropped): the controller measures it and
changes only when the faster choice repays it within `payback` steps. A draft length whose cost
is unknown is tried (a CPU times nothing at start-up), and below num_steps it probes one step
deeper now and then: position k + 1 is never judged at k, so its rate would otherwise stay
whatever it last was. A probe that changes nothing doubles the wait for the next; a probe from
plain steps (a round and back) waits besides until its measured cost is at most `probe_share` of
the time between probes, and none comes while no round could beat plain steps even with every
draft accepted (a round of k drafts costing k + 1 plain steps or more). At rounds, plain steps
are re-checked now and then the same way (a change to them, judged again after
`stay_after_change` steps): their figure is what they cost when they last ran, and a host's
speed drifts; coming back to a k restarts its cost entry (`CostModel.restart`).

A step is steady when it ran the k of the step before and nothing else ran in its time, and it is
not one of the first `settle_steps` from a change between plain steps and rounds (they run slower
than the steps after them while the pipeline and the host warm up again: timed into its entry,
the first plain steps of a re-check from rounds made plain steps look dearer than rounds and kept
the controller at rounds for good): its time refreshes its cost entry. The others (a change and
the steps settling after it, a probe, a catch-up) are what changing costs: what they took beyond
their entries is told to the cost model once steps are steady again. A k reached by a change
between plain steps and rounds is kept until it has been timed (`stay_after_change`).

Steady at plain steps, the controller grants the plain steps up to its next decision ahead
(`PlainLease`): the speculative worker runs them without asking and the engine keeps their times
in the lease instead of telling each (on a host-bound model every call a plain step makes is a
share of its time); the controller takes them in, as though told one by one, when it is next
asked or told anything else.

`FixedDraftSteps` is `speculative.adaptive: false`: num_steps every step. `RelayedDraftSteps`
runs what rank 0 of a tensor-parallel group chose.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Protocol

import numpy as np

from workers.speculative.cost_model import EXCURSION, SWITCH, CostModel


class DraftSteps(Protocol):
    """What the speculative worker asks every decode step and tells after it (a controller may
    also hold a `lease: PlainLease` of steps granted ahead; one without grants none)."""

    def choose(self, batch_size: int, expected_tokens: Callable[[], np.ndarray]) -> int:
        """k for this step; `expected_tokens()[k]`: the batch's expected tokens from k draft
        steps. Calling it again before `observe` gives the same answer."""
        ...

    def observe(self, batch_size: int, k: int, seconds: float | None, clean: bool = True) -> None:
        """A decode step of `k` draft steps ran, `seconds` after the step told before it ended
        (None: unknown, no decode step came right before); `clean`: nothing else ran in that
        time (no catch-up after plain steps, no work launched ahead and dropped)."""
        ...


@dataclasses.dataclass
class PlainLease:
    """Plain decode steps granted ahead: while `steps` remain, a decode step of `batch_size`
    requests runs plain without asking `choose`; while `seconds` is a list, the time of a decode
    step told the way the shortcut for steady steps takes it (plain, of `batch_size` requests,
    known and clean) goes there instead of to `observe`."""

    steps: int = 0
    batch_size: int = -1
    seconds: list[float] | None = None  # None: no lease open


@dataclasses.dataclass
class FixedDraftSteps:
    num_steps: int

    def choose(self, batch_size: int, expected_tokens: Callable[[], np.ndarray]) -> int:
        return self.num_steps

    def observe(self, batch_size: int, k: int, seconds: float | None, clean: bool = True) -> None:
        """Nothing to learn."""


@dataclasses.dataclass
class AdaptiveDraftSteps:
    costs: CostModel
    margin: float = 0.05  # leave the current k only for one expected this much faster
    dwell: int = 4  # steps at a k before leaving it
    settle_steps: int = 8  # steps from a change between plain steps and rounds (it included) counted as the change's
    plain_dwell: int = 32  # steps at plain decoding before a decision while the batch size stays
    max_plain_dwell: int = 256  # the wait between decisions at plain steps, doubled after each that kept them
    probe_after: int = 32  # steps below num_steps before a step one draft deeper
    max_probe_after: int = 1024  # the wait for probes, doubled after each that changed nothing
    payback: int = 64  # steps at the new k within which a change between plain steps and rounds repays itself
    probe_share: float = 0.01  # of the time at plain steps that probing from them may cost
    leases: bool = True  # plain steps granted ahead (off for a relayed group's lead: no worker runs them)
    k: int = dataclasses.field(init=False)  # the current choice (probes aside)

    def __post_init__(self) -> None:
        self.k = self.num_steps
        self._steps = 0  # steps at k
        self._stay = self.dwell  # steps at k before it may be left (`stay_after_change` after a change of kind)
        self._last = -1  # the k of the last step
        self._settling = 0  # steps still to come whose time counts towards a change of kind
        self._since_probe = 0  # steps since the last probe (or change)
        self._probe_wait = self.probe_after
        self._probed = False  # the last step was a probe
        self._probe: int | None = None  # the probe `choose` returned, until a step is told
        self._steady: int | None = None  # the k of the last steady step
        self._decided_for = 0  # the batch size of the last step that decided
        self._plain_wait = self.plain_dwell  # steps between decisions at plain steps (`_decide_at`)
        self._decide_at = self.plain_dwell  # the count of steps at plain decoding that next decides
        self._deciding: int | None = None  # the batch size `choose` decided for, until a step is told
        # The unsteady steps since it: (batch size, k, seconds); None once one took unknown time.
        self._unsteady: list[tuple[int, int, float]] | None = []
        self._at_rounds = 0  # steps at rounds since the last plain step
        self._recheck_wait = self.probe_after  # steps at rounds before plain steps are re-checked
        self._recheck = False  # `choose` returned a re-check of plain steps, until a step is told
        self._rechecking = False  # at plain steps for a re-check, until judged
        self._calm = False  # the last step was steady at k and nothing waits: a steady step at k only counts
        self.lease = PlainLease()  # plain steps granted ahead (`_grant`), taken in by `settle` (one object throughout)

    @property
    def num_steps(self) -> int:
        return self.costs.num_steps

    @property
    def stay_after_change(self) -> int:
        """Steps at a k reached by a change between plain steps and rounds before it may be left:
        the `settle_steps` untimed, then `dwell` - 1 at least, up to the next decision (decisions
        come every `dwell` steps)."""
        return self.dwell * math.ceil((self.dwell + max(0, self.settle_steps - 1)) / self.dwell)

    def rates(self, batch_size: int, expected_tokens: np.ndarray) -> list[float | None]:
        """Expected tokens per second for each k (None: its cost unknown)."""
        return _rates(expected_tokens, self.costs.seconds(batch_size))

    def choose(self, batch_size: int, expected_tokens: Callable[[], np.ndarray]) -> int:
        if self.lease.seconds is not None:
            self.settle()
        if self._steps < self._stay:
            return self.k
        calm_plain = self.k == 0 and batch_size == self._decided_for and not self._rechecking
        if (self._steps < self._decide_at) if calm_plain else (self._steps % self.dwell):
            return self.k
        self._deciding, self._calm = batch_size, False
        tokens, costs = expected_tokens(), self.costs.seconds(batch_size)
        rates = _rates(tokens, costs)
        unknown = [k for k, r in enumerate(rates) if r is None]
        if unknown:  # measure it: nothing else tells what it costs
            return unknown[-1]
        best = max(range(len(rates)), key=lambda k: (rates[k], k))
        if rates[best] > rates[self.k] * (1.0 + self.margin) and self._repays(batch_size, best, rates, costs):
            return best
        if self._recheck_due(batch_size, tokens, rates, costs):
            self._recheck = True
            return 0
        probe_in = self._probe_in(batch_size, tokens, costs)
        if probe_in <= 0:
            self._probe = self.k + 1
            return self._probe
        if self.k == 0:  # kept: the next decision waits longer, up to the probe's due step
            self._plain_wait = min(2 * self._plain_wait, self.max_plain_dwell) if calm_plain else self.plain_dwell
            self._decide_at = self._steps + math.ceil(min(self._plain_wait, probe_in))
        return self.k

    def observe(self, batch_size: int, k: int, seconds: float | None, clean: bool = True) -> None:
        """Counts the step: at k, a probe, or a change of k. A steady step (the k of the step
        before, its time known and clean) refreshes its cost entry; the others count towards
        what changing costs."""
        if self.lease.seconds is not None:
            self.settle()
        if self._calm and k == self.k and clean and seconds is not None:  # the common step: nothing else to do
            self.costs.observe(batch_size, k, seconds)
            self._steps += 1
            self._since_probe += 1
            if k:
                self._at_rounds += 1
            else:
                self._grant(batch_size)
            return
        if self._deciding is not None:
            self._decided_for, self._deciding = self._deciding, None
        settling = self._settling > 0
        if self._last >= 0 and (k == 0) != (self._last == 0):  # a change of kind: the steps after it settle
            self._settling = self.settle_steps - 1
        elif settling:
            self._settling -= 1
        steady = seconds is not None and clean and k == self._last and not settling
        if steady:
            self.costs.observe(batch_size, k, seconds)
        if steady and self._unsteady == []:  # steady steps in a row (the common step): nothing to tell
            self._steady = k
        else:
            self._account(batch_size, k, seconds, steady)
        self._last = k
        self._at_rounds = self._at_rounds + 1 if k else 0
        if self._probed:  # the step after a probe: back at k (it changed nothing) or moved on
            self._probe_wait = min(2 * self._probe_wait, self.max_probe_after) if k == self.k else self.probe_after
            self._probed = False
        if k == self.k:
            self._steps += 1
            self._since_probe += 1
        elif k == self._probe:
            self._probed, self._since_probe = True, 0
        else:
            self._judge_recheck(k)
            self._rechecking = k == 0 and self._recheck
            self._stay = self.stay_after_change if (k == 0) != (self.k == 0) else self.dwell
            self.k, self._steps, self._since_probe = k, 1, 1
            self._plain_wait = self._decide_at = self.plain_dwell
            self.costs.restart(batch_size, k)
        if self._rechecking and self._steps > self._stay:  # plain steps kept when judged: the re-check paid
            self._judge_recheck(0)
        self._probe, self._recheck = None, False
        self._calm = steady and k == self.k and not self._probed and not self._rechecking  # (steady: nothing unsteady)
        if self._calm and k == 0:
            self._grant(batch_size)

    def _grant(self, batch_size: int) -> None:
        """Calm at plain steps: lease the steps of this batch size that `choose` would answer
        without deciding (asked once between every two tells, as the engine does), up to the
        first step whose count of steps at k is a decision's (`choose`)."""
        if not self.leases or batch_size != self._decided_for:  # (the next ask decides within `dwell` steps)
            return
        steps = self._steps
        decides = max(self.dwell, self._decide_at)
        if decides > steps:
            lease = self.lease
            lease.steps, lease.batch_size, lease.seconds = decides - steps, batch_size, []

    def settle(self) -> None:
        """Take in the leased steps told so far, each as the shortcut for steady plain steps
        would have; the steps not yet run are asked for again (a reader of `costs` first)."""
        lease = self.lease
        told, lease.seconds, lease.steps = lease.seconds, None, 0
        if told is None:
            return
        self.costs.observe_all(lease.batch_size, 0, told)
        self._steps += len(told)
        self._since_probe += len(told)

    def _judge_recheck(self, k: int) -> None:
        """A re-check of plain steps ends at k: back at rounds doubles the wait for the next."""
        if self._rechecking:
            self._recheck_wait = min(2 * self._recheck_wait, self.max_probe_after) if k else self.probe_after
            self._rechecking = False

    def _repays(self, batch_size: int, best: int, rates: list[float], costs: list[float]) -> bool:
        """Whether leaving k for `best` saves, over `payback` steps at best, more than the change
        costs: a change between plain steps and rounds its measured cost (between round lengths
        nothing is drained or caught up)."""
        if (best == 0) == (self.k == 0):
            return True
        saved = self.payback * costs[best] * (rates[best] / rates[self.k] - 1.0)
        return saved > self.costs.change_seconds(batch_size, SWITCH)

    def _recheck_due(self, batch_size: int, tokens: np.ndarray, rates: list[float], costs: list[float]) -> bool:
        """Whether plain steps are due a re-check from rounds: `_recheck_wait` steps at rounds
        since the last plain step, and no sooner than its cost (two switches, as measured, and
        `dwell` plain steps' loss against rounds, as estimated) is `probe_share` of the time at
        rounds since."""
        if self.k == 0:
            return False
        loss = self.stay_after_change * max(0.0, costs[0] - float(tokens[0]) / rates[self.k])
        cost = 2.0 * self.costs.change_seconds(batch_size, SWITCH) + loss
        return self._at_rounds >= max(self._recheck_wait, cost / (self.probe_share * costs[self.k]))

    def _probe_in(self, batch_size: int, tokens: np.ndarray, costs: list[float]) -> float:
        """Steps until a step one draft deeper is due (at most 0: now): `_probe_wait` steps at
        k; from plain steps also no sooner than its cost (the excursion's, measured, else two
        switches'; and the round's loss against plain steps) is `probe_share` of the time at
        plain steps since the last; never from plain steps while no round length could beat them
        were every draft accepted (a round of k drafts costing k + 1 plain steps or more): what a
        probe learns, the acceptance, could not make rounds pay."""
        if self.k >= self.num_steps or (self.k == 0 and not _rounds_could_pay(costs)):
            return float("inf")
        wait = self._probe_wait
        if self.k == 0:
            loss = max(0.0, costs[1] - costs[0] * float(tokens[1]) / float(tokens[0]))
            excursion = self.costs.change_seconds(batch_size, EXCURSION) or 2.0 * self.costs.change_seconds(
                batch_size, SWITCH
            )
            wait = max(wait, (loss + excursion) / (self.probe_share * costs[0]))
        return wait - self._since_probe

    def _account(self, batch_size: int, k: int, seconds: float | None, steady: bool) -> None:
        """What the unsteady steps since the last steady one took beyond their entries (as they
        stand once steady again: a new k's first entry is measured only then), told to the cost
        model at the next steady step if another k ran meanwhile: a switch when they left plain
        steps for rounds or came back, an excursion when they left plain steps and came back
        (between round lengths: nothing). A step of unknown time leaves it unknown."""
        if not steady:
            if self._unsteady is not None:
                self._unsteady = None if seconds is None else [*self._unsteady, (batch_size, k, seconds)]
            return
        steps = self._unsteady
        if steps is None:  # (a step of unknown time since the last steady one: nothing to tell)
            self._steady, self._unsteady = k, []
            return
        self._unsteady = []
        if self._steady is None or all(j == self._steady for _, j, _ in steps):
            self._steady = k
            return
        left, back, self._steady = self._steady == 0, k == 0, k
        kind = SWITCH if left != back else EXCURSION if left else None
        entries = [self.costs.seconds(b)[j] for b, j, _ in steps]
        if kind is not None and None not in entries:
            excess = sum(seconds for _, _, seconds in steps) - sum(entries)
            self.costs.observe_change(batch_size, kind, excess)


def _rounds_could_pay(costs: list[float]) -> bool:
    """Whether a round of some k drafts costs less than k + 1 plain steps (`costs[0]` each): the
    tokens it yields with every draft accepted."""
    return any((k + 1) * costs[0] > cost for k, cost in enumerate(costs) if k)


def _rates(tokens: np.ndarray, costs: list[float | None]) -> list[float | None]:
    return [None if c is None else float(t) / c for t, c in zip(tokens, costs)]


@dataclasses.dataclass
class RelayedDraftSteps:
    """The draft lengths of a tensor-parallel group: every rank runs `k`, which rank 0's
    controller (`lead`) chose before the step and its step plan carried (`workers/rank_loop.py`),
    so that the ranks stay in lockstep whatever each of them measures."""

    lead: DraftSteps
    k: int

    def choose(self, batch_size: int, expected_tokens: Callable[[], np.ndarray]) -> int:
        return self.k

    def observe(self, batch_size: int, k: int, seconds: float | None, clean: bool = True) -> None:
        self.lead.observe(batch_size, k, seconds, clean)

    def propose(self, batch_size: int, expected_tokens: Callable[[], np.ndarray]) -> int:
        """Rank 0: what the group's next decode step runs."""
        return self.lead.choose(batch_size, expected_tokens)
