"""How many draft steps each decode step runs: speculation that never loses (docs/design.md §6.1).

Speculation pays only while the tokens a round adds outrun what the round costs beyond a plain
step, and that balance moves with the batch size, the text and the model. Every decode step the
adaptive controller picks k in 0..num_steps for the batch (0: a plain decode step, the draft
catching up later) maximising expected tokens per second: the acceptance model's expected
tokens for k (`acceptance.py`) over the cost model's seconds for k at this batch size
(`cost_model.py`). Against flapping it keeps a choice for at least `dwell` steps and leaves it
only for one expected to be `margin` faster; it decides every `dwell` steps (a decision's host
time is paid once in that many). A draft length whose cost is unknown is tried (a CPU times
nothing at start-up), and below num_steps it probes one step deeper now and then: position k + 1
is never judged at k, so its rate would otherwise stay whatever it last was. A probe that changes
nothing doubles the wait for the next.

`FixedDraftSteps` is `speculative.adaptive: false`: num_steps every step. `RelayedDraftSteps`
runs what rank 0 of a tensor-parallel group chose.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

import numpy as np

from workers.speculative.cost_model import CostModel


class DraftSteps(Protocol):
    """What the speculative worker asks every decode step and tells after it."""

    def choose(self, batch_size: int, expected_tokens: Callable[[], np.ndarray]) -> int:
        """k for this step; `expected_tokens()[k]`: the batch's expected tokens from k draft
        steps. Calling it again before `observe` gives the same answer."""
        ...

    def observe(self, batch_size: int, k: int, seconds: float | None) -> None:
        """A decode step of `k` draft steps ran (seconds None: not timed, a step whose time says
        nothing about its kind)."""
        ...


@dataclasses.dataclass
class FixedDraftSteps:
    num_steps: int

    def choose(self, batch_size: int, expected_tokens: Callable[[], np.ndarray]) -> int:
        return self.num_steps

    def observe(self, batch_size: int, k: int, seconds: float | None) -> None:
        """Nothing to learn."""


@dataclasses.dataclass
class AdaptiveDraftSteps:
    costs: CostModel
    margin: float = 0.05  # leave the current k only for one expected this much faster
    dwell: int = 4  # steps at a k before leaving it
    probe_after: int = 32  # steps below num_steps before a step one draft deeper
    max_probe_after: int = 1024  # the wait for probes, doubled after each that changed nothing
    k: int = dataclasses.field(init=False)  # the current choice (probes aside)

    def __post_init__(self) -> None:
        self.k = self.num_steps
        self._steps = 0  # steps at k
        self._last = -1  # the k of the last step
        self._since_probe = 0  # steps since the last probe (or change)
        self._probe_wait = self.probe_after
        self._probed = False  # the last step was a probe

    @property
    def num_steps(self) -> int:
        return self.costs.num_steps

    def rates(self, batch_size: int, expected_tokens: np.ndarray) -> list[float | None]:
        """Expected tokens per second for each k (None: its cost unknown)."""
        costs = self.costs.seconds(batch_size)
        return [None if c is None else float(t) / c for t, c in zip(expected_tokens, costs)]

    def choose(self, batch_size: int, expected_tokens: Callable[[], np.ndarray]) -> int:
        if self._steps < self.dwell or self._steps % self.dwell:  # decided every `dwell` steps
            return self.k
        rates = self.rates(batch_size, expected_tokens())
        unknown = [k for k, r in enumerate(rates) if r is None]
        if unknown:  # measure it: nothing else tells what it costs
            return unknown[-1]
        best = max(range(len(rates)), key=lambda k: (rates[k], k))
        if rates[best] > rates[self.k] * (1.0 + self.margin):
            return best
        if self._probe_due:
            return self.k + 1
        return self.k

    def observe(self, batch_size: int, k: int, seconds: float | None) -> None:
        """Counts the step: at k, a probe, or a change of k. A step is timed only when the step
        before ran the same k (otherwise its time holds the change: a round launched ahead and
        discarded, a draft catching up)."""
        if seconds is not None and k == self._last:
            self.costs.observe(batch_size, k, seconds)
        self._last = k
        if self._probed:  # the step after a probe: back at k (it changed nothing) or moved on
            self._probe_wait = min(2 * self._probe_wait, self.max_probe_after) if k == self.k else self.probe_after
            self._probed = False
        if k == self.k:
            self._steps += 1
            self._since_probe += 1
        elif k == self.k + 1 and self._probe_due:
            self._probed, self._since_probe = True, 0
        else:
            self.k, self._steps, self._since_probe = k, 1, 1

    @property
    def _probe_due(self) -> bool:
        return self.k < self.num_steps and self._since_probe >= self._probe_wait


@dataclasses.dataclass
class RelayedDraftSteps:
    """The draft lengths of a tensor-parallel group: every rank runs `k`, which rank 0's
    controller (`lead`) chose before the step and its step plan carried (`workers/rank_loop.py`),
    so that the ranks stay in lockstep whatever each of them measures."""

    lead: DraftSteps
    k: int

    def choose(self, batch_size: int, expected_tokens: Callable[[], np.ndarray]) -> int:
        return self.k

    def observe(self, batch_size: int, k: int, seconds: float | None) -> None:
        self.lead.observe(batch_size, k, seconds)

    def propose(self, batch_size: int, expected_tokens: Callable[[], np.ndarray]) -> int:
        """Rank 0: what the group's next decode step runs."""
        return self.lead.choose(batch_size, expected_tokens)
