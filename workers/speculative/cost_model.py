"""What a decode step costs, by batch size and draft length: the denominator of the controller's
tokens per second (`workers/speculative/controller.py`).

One entry per batch-size bucket (the captured graph sizes: a batch runs padded to the smallest
that holds it) and draft length k in 0..num_steps: the seconds of a plain decode step (k = 0) or
of a round of k draft steps, its verify and the draft's catch-up. With CUDA graphs a start-up
measurement of their replays gives every entry a prior (`round_timing.py`); while serving, each
decode step's measured time refreshes its entry as an exponential moving average, so that the
host's share, which replays alone leave out, is counted. An entry not measured yet is its prior:
an optimistic figure (it leaves the host out), so that the controller tries that draft length and
measures it rather than rules it out on a guess; scaling priors by what the bucket's measured
entries took would guess wrong both ways (a round's host work is not a plain step's). An entry
with neither is unknown (a CPU has no start-up timing) and the controller tries it too.
"""

from __future__ import annotations

import bisect
import dataclasses


@dataclasses.dataclass
class CostModel:
    buckets: list[int]  # batch sizes, ascending; a batch counts as the smallest bucket holding it
    num_steps: int  # draft lengths 0..num_steps
    weight: float = 0.2  # of a new measurement in its entry's moving average
    prior: dict[tuple[int, int], float] = dataclasses.field(default_factory=dict)  # (bucket, k) -> s, start-up
    measured: dict[tuple[int, int], float] = dataclasses.field(default_factory=dict)  # (bucket, k) -> s, serving

    def __post_init__(self) -> None:
        if not self.buckets or sorted(set(self.buckets)) != list(self.buckets) or self.buckets[0] < 1:
            raise ValueError(f"cost model: buckets must be ascending distinct sizes >= 1, got {self.buckets}")
        if not 0.0 < self.weight <= 1.0:
            raise ValueError(f"cost model: weight must be in (0, 1], got {self.weight}")

    def bucket(self, batch_size: int) -> int:
        """The bucket a batch of `batch_size` requests counts in (the largest past the last)."""
        i = bisect.bisect_left(self.buckets, batch_size)
        return self.buckets[min(i, len(self.buckets) - 1)]

    def set_prior(self, bucket: int, k: int, seconds: float) -> None:
        self._check(k, seconds)
        if bucket not in self.buckets:
            raise ValueError(f"cost model: bucket {bucket} is not one of {self.buckets}")
        self.prior[(bucket, k)] = seconds

    def observe(self, batch_size: int, k: int, seconds: float) -> None:
        """A decode step of `batch_size` requests and `k` draft steps took `seconds`."""
        self._check(k, seconds)
        key = (self.bucket(batch_size), k)
        old = self.measured.get(key)
        self.measured[key] = seconds if old is None else old + self.weight * (seconds - old)

    def seconds(self, batch_size: int) -> list[float | None]:
        """The expected seconds of a step of `batch_size` requests for each k in 0..num_steps:
        measured, else the prior; None where neither is known."""
        b = self.bucket(batch_size)
        return [self.measured.get((b, k), self.prior.get((b, k))) for k in range(self.num_steps + 1)]

    def _check(self, k: int, seconds: float) -> None:
        if not 0 <= k <= self.num_steps:
            raise ValueError(f"cost model: draft length {k} outside 0..{self.num_steps}")
        if not seconds > 0.0:
            raise ValueError(f"cost model: a step must take a positive time, got {seconds} s")
