"""How many tokens a round of k draft steps is expected to yield: the numerator of the
controller's tokens per second (`workers/speculative/controller.py`).

A round verifies drafts 1..k in order and keeps them up to the first the target rejects, then
adds the target's own token. Position i is judged only when drafts 1..i-1 were accepted, so what
is measured per position is the conditional rate a_i = P(draft i accepted | drafts before it
accepted), from decayed counts (recent judgements weigh more): one set for the draft model (every
request it drafts for) and one per request, which starts at the draft's rate and leans on its own
counts as they grow (`pseudo_counts` judgements at the draft's rate stand beside them). A request
expects 1 + sum_{j<=k} prod_{i<=j} a_i tokens from k steps; a batch the sum over its requests.

Per-request counts are rows of one table indexed by the request's row in the request->token
table, so that a step's estimate for every k is a few array operations whatever the batch size
(the controller asks every step).
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class AcceptanceModel:
    num_steps: int
    rows: int  # request rows (the engine's running-request capacity)
    draft_horizon: float = 512.0  # judgements per position the draft's counts remember (about)
    request_horizon: float = 64.0  # the same for one request's
    prior: float = 1.0  # the rate of a position never judged (optimistic: it gets tried)
    pseudo_counts: float = 4.0  # judgements at the draft's rate that stand beside a request's own

    def __post_init__(self) -> None:
        if not 0.0 <= self.prior <= 1.0:
            raise ValueError(f"acceptance: prior must be in [0, 1], got {self.prior}")
        for name in ("draft_horizon", "request_horizon"):
            if getattr(self, name) < 1.0:
                raise ValueError(f"acceptance: {name} must be >= 1, got {getattr(self, name)}")
        k = self.num_steps
        self.draft_judged, self.draft_accepted = np.zeros(k), np.zeros(k)
        self.judged, self.accepted = np.zeros((self.rows, k)), np.zeros((self.rows, k))
        self._positions = np.arange(k)
        self._last: tuple[tuple[int, ...], np.ndarray] | None = None  # the last estimate, until a count changes

    def start(self, rows: list[int]) -> None:
        """New requests on these rows: their own counts start from nothing."""
        self._last = None
        self.judged[rows] = 0.0
        self.accepted[rows] = 0.0

    def record(self, rows: list[int], k: int, accepted: list[int]) -> None:
        """A round of `k` drafts for the requests on `rows` kept `accepted[i]` of request i's:
        positions 1..accepted were accepted, position accepted + 1 (if drafted) rejected, later
        ones not judged."""
        got = np.asarray(accepted)
        if not 0 <= k <= self.num_steps or len(got) != len(rows) or ((got < 0) | (got > k)).any():
            raise ValueError(f"acceptance: accepted counts {accepted} of {k} drafts (at most {self.num_steps})")
        self._last = None
        judged = self._positions < np.minimum(got + 1, k)[:, None]  # [B, K]
        kept = self._positions < got[:, None]
        keep = np.where(judged, 1.0 - 1.0 / self.request_horizon, 1.0)  # what an old count keeps
        self.judged[rows] = self.judged[rows] * keep + judged
        self.accepted[rows] = self.accepted[rows] * keep + kept
        n = judged.sum(axis=0)
        old = (1.0 - 1.0 / self.draft_horizon) ** n
        self.draft_judged = self.draft_judged * old + n
        self.draft_accepted = self.draft_accepted * old + kept.sum(axis=0)

    def draft_rates(self) -> np.ndarray:
        """The draft's conditional acceptance rate per position (one judgement at the prior
        stands beside its counts)."""
        return (self.draft_accepted + self.prior) / (self.draft_judged + 1.0)

    def rates(self, rows: list[int]) -> np.ndarray:
        """`[B, num_steps]`: each request's conditional acceptance rate per position."""
        m = self.pseudo_counts
        return (self.accepted[rows] + m * self.draft_rates()) / (self.judged[rows] + m)

    def expected_tokens(self, rows: list[int]) -> np.ndarray:
        """`[num_steps + 1]`: tokens a round of k draft steps is expected to commit for the
        requests on `rows`, for k = 0 (a plain decode step: one each) .. num_steps. Between plain
        decode steps nothing changes: the last estimate stands until a count does."""
        key = tuple(rows)
        if self._last is None or self._last[0] != key:
            reach = np.cumprod(self.rates(rows), axis=1).sum(axis=0)  # [K]: expected drafts kept at each position
            self._last = key, len(rows) + np.concatenate([[0.0], np.cumsum(reach)])
        return self._last[1]
