"""What a decode step costs, by batch size and draft length: the denominator of the controller's
tokens per second (`workers/speculative/controller.py`), and what changing between plain steps
and rounds costs beyond the steps themselves.

One entry per batch-size bucket (the captured graph sizes: a batch runs padded to the smallest
that holds it) and draft length k in 0..num_steps: the seconds of a plain decode step (k = 0) or
of a round of k draft steps, its verify and the draft's catch-up. With CUDA graphs a start-up
measurement of their replays gives every entry a prior (`round_timing.py`); while serving, each
steady decode step's measured time refreshes its entry, so that the host's share, which replays
alone leave out, is counted. An entry is the median of its last `window` measurements: a host's
step times have a long tail (a tiny model's plain steps on one H200 host: 90th percentile up to
1.7x the median), a moving average holds a slow step for several steps after it, and a decision
taken meanwhile can leave a k for good. The controller restarts an entry when it comes back to its k after others
(`restart`): a host's speed drifts by 2x over minutes, so what an entry measured before is not
mixed with what it measures now. Meanwhile the other entries of its bucket follow that drift: once
the entry measured now holds a full window since its start (the bucket's reference), an entry
taken before is read scaled by how far the reference's figure moved since (since the entry was
taken, where that was later), no further than `MAX_DRIFT` either way: a host-bound step's time
moves with the host whatever its kind (three runs on one H200 host, the tiny target's MTP head at
batch 16 stepped in turns with an engine held at plain steps: plain steps 0.55 to 0.72 ms, rounds
2.6 to 3.2 ms, the ratio of the two within 5%), and so the kinds are compared as
they stood when both were last measured, close in time, until a re-check measures them again.
Without it the other kind's figure stayed what a slow stretch left it: plain steps measured
slow, then rounds measured fast, kept the controller at rounds at 72% of plain decoding (the tiny
target's MTP head at batch 16) until a re-check, which a dear switch puts off for hundreds of
rounds. Chaining references (each scaled by the one before) would sum the noise of every stretch
and of the controller leaving each when its figure looked high: on random tables it wandered
16x with no drift at all; one reference at a time holds the noise to two medians' worth.
An entry not measured yet is its
prior plus what serving added to the prior of the nearest measured entry of its kind (a plain
step's to a plain step's, a round's to a round's: their host work differs; the same bucket
first, then the nearest bucket): a bucket never served is not explored round by round on
replay-only figures that every measurement so far found several times too low, while a kind
never measured keeps its optimistic prior and is tried. An entry with neither is unknown (a CPU
has no start-up timing) and the controller tries it too.

Changing costs too, and no step's entry holds it: the drain of the overlapped plain pipeline and
the draft's catch-up before a round, the work launched ahead for a next round that a plain step
drops, the launch that restarts the pipeline. Per bucket, moving averages of what the steps of a
change took beyond their entries: `SWITCH`, a change between plain steps and rounds (either way),
and `EXCURSION`, a round run from plain steps and back (a probe). A bucket without its own
figure takes the nearest smaller bucket's (changing costs grow with the batch). The averages take
what the steps took beyond their entries as measured, below zero too, and are read no lower than
zero: a step's time is noisy both ways, and clipping each measurement at zero biases the figure
up, which puts off the re-checks it prices (a switch of the MTP head at batch 16 read 14 ms).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import math
import statistics

SWITCH = "switch"  # between plain steps and rounds, either way
EXCURSION = "excursion"  # from plain steps to a round and back
MAX_DRIFT = 2.0  # the most an entry measured before is scaled by the host's drift since, either way


@dataclasses.dataclass
class CostModel:
    buckets: list[int]  # batch sizes, ascending; a batch counts as the smallest bucket holding it
    num_steps: int  # draft lengths 0..num_steps
    window: int = 8  # measurements an entry keeps: its figure is their median
    weight: float = 0.2  # of a new measurement in a change's moving average
    prior: dict[tuple[int, int], float] = dataclasses.field(default_factory=dict)  # (bucket, k) -> s, start-up
    measured: dict[tuple[int, int], float] = dataclasses.field(default_factory=dict)  # (bucket, k) -> s, serving
    changes: dict[tuple[int, str], float] = dataclasses.field(default_factory=dict)  # (bucket, kind) -> s, serving

    def __post_init__(self) -> None:
        if not self.buckets or sorted(set(self.buckets)) != list(self.buckets) or self.buckets[0] < 1:
            raise ValueError(f"cost model: buckets must be ascending distinct sizes >= 1, got {self.buckets}")
        if self.window < 1:
            raise ValueError(f"cost model: window must be >= 1 measurement, got {self.window}")
        if not 0.0 < self.weight <= 1.0:
            raise ValueError(f"cost model: weight must be in (0, 1], got {self.weight}")
        self._nearest: dict[tuple[int, int], tuple[int, int] | None] = {}  # `_added`'s choice, until an entry is new
        self._bucket_of: dict[int, int] = {}  # batch size -> its bucket
        self._recent: dict[tuple[int, int], collections.deque] = {}  # each entry's last measurements
        self._unread: set[tuple[int, int]] = set()  # entries measured since their figure was last taken
        self._restarted: set[tuple[int, int]] = set()  # entries whose next measurement starts them afresh
        # Per bucket, the entry measured now once it holds a full window since its start, and its
        # figure then: the others are read scaled by how far its figure moved since (`_figure`).
        self._reference: dict[int, tuple[tuple[int, int], float]] = {}  # (its key, its figure then)
        self._taken_at: dict[tuple[int, int], tuple[tuple, float]] = {}  # the reference then (itself) and its figure
        # (batch size, k, its entry's measurements) of the last measurement, until its entry is read
        # or restarted: the next measurement of the same step appends there and nothing else
        self._hot: tuple[int, int, collections.deque] | None = None

    def bucket(self, batch_size: int) -> int:
        """The bucket a batch of `batch_size` requests counts in (the largest past the last);
        looked up once per size (it is asked every decode step)."""
        bucket = self._bucket_of.get(batch_size)
        if bucket is None:
            i = bisect.bisect_left(self.buckets, batch_size)
            bucket = self._bucket_of[batch_size] = self.buckets[min(i, len(self.buckets) - 1)]
        return bucket

    def set_prior(self, bucket: int, k: int, seconds: float) -> None:
        self._check(k, seconds)
        if bucket not in self.buckets:
            raise ValueError(f"cost model: bucket {bucket} is not one of {self.buckets}")
        self.prior[(bucket, k)] = seconds
        self._nearest.clear()

    def observe(self, batch_size: int, k: int, seconds: float) -> None:
        """A steady decode step of `batch_size` requests and `k` draft steps took `seconds`
        (kept: the entry's median is taken when it is next read, at a decision every few steps)."""
        hot = self._hot
        if hot is not None and hot[0] == batch_size and hot[1] == k and seconds > 0.0:  # (told every step)
            hot[2].append(seconds)
            return
        if not (0 <= k <= self.num_steps and seconds > 0.0):
            self._check(k, seconds)
        bucket = self._bucket_of.get(batch_size)
        key = (bucket if bucket is not None else self.bucket(batch_size), k)
        recent = self._recent.get(key)
        if recent is None:
            recent = self._recent[key] = collections.deque(maxlen=self.window)
            self._nearest.clear()
        elif key in self._restarted:
            recent.clear()
            self._restarted.discard(key)
            if self._reference.get(key[0], (None,))[0] == key:
                del self._reference[key[0]]
        recent.append(seconds)
        self._unread.add(key)
        self._hot = (batch_size, k, recent)

    def observe_all(self, batch_size: int, k: int, seconds: list[float]) -> None:
        """`observe` each of `seconds` in turn (steps a controller leased, taken in at once)."""
        if seconds and min(seconds) > 0.0:
            self.observe(batch_size, k, seconds[0])
            self._hot[2].extend(seconds[1:])  # (the entry the first went to)
        else:
            for each in seconds:
                self.observe(batch_size, k, each)

    def restart(self, batch_size: int, k: int) -> None:
        """The entry of `k` at this batch size starts afresh with its next measurement (its
        figure stands until then)."""
        key = (self.bucket(batch_size), k)
        if key in self._recent:
            self._restarted.add(key)
            self._hot = None

    def observe_change(self, batch_size: int, kind: str, seconds: float) -> None:
        """A change of `kind` (`SWITCH`, `EXCURSION`) took `seconds` beyond its steps' entries
        (below zero where they ran faster than their entries)."""
        if kind not in (SWITCH, EXCURSION) or not math.isfinite(seconds):
            raise ValueError(
                f"cost model: a change is {SWITCH} or {EXCURSION} and takes finite seconds, got {kind} {seconds}"
            )
        self._average(self.changes, (self.bucket(batch_size), kind), seconds)

    def seconds(self, batch_size: int) -> list[float | None]:
        """The expected seconds of a step of `batch_size` requests for each k in 0..num_steps:
        measured, else the prior and what serving added to the nearest measured entry of its
        kind; None where neither is known."""
        for key in self._unread:  # each entry measured since: the median of its recent measurements
            self._take(key, statistics.median(self._recent[key]))
        self._unread.clear()
        self._hot = None
        b = self.bucket(batch_size)
        out: list[float | None] = []
        for k in range(self.num_steps + 1):
            seconds = self._figure((b, k))
            if seconds is None and (b, k) in self.prior:
                seconds = self.prior[(b, k)] + self._added(b, k)
            out.append(seconds)
        return out

    def _take(self, key: tuple[int, int], figure: float) -> None:
        """An entry's new figure; the first from a full window since its start makes it its
        bucket's reference."""
        self.measured[key] = figure
        reference = self._reference.get(key[0])
        if reference is not None and reference[0] == key:
            return
        if len(self._recent[key]) == self.window:
            self._reference[key[0]] = (key, figure)
        elif reference is not None:
            self._taken_at[key] = (reference, self.measured[reference[0]])

    def _figure(self, key: tuple[int, int]) -> float | None:
        """An entry's measured figure, scaled, where another entry of its bucket is measured now,
        by how far that one's figure moved since the entry was taken or, taken before, since its
        window first filled (at most `MAX_DRIFT` either way)."""
        seconds = self.measured.get(key)
        reference = self._reference.get(key[0])
        if seconds is None or reference is None or reference[0] == key:
            return seconds
        taken = self._taken_at.get(key)
        since = taken[1] if taken is not None and taken[0] is reference else reference[1]
        drift = self.measured[reference[0]] / since
        return seconds * min(MAX_DRIFT, max(1.0 / MAX_DRIFT, drift))

    def change_seconds(self, batch_size: int, kind: str) -> float:
        """What a change of `kind` is expected to cost beyond its steps: this bucket's figure,
        else the nearest smaller bucket's; 0 where none was measured (the change is tried)."""
        b = self.bucket(batch_size)
        smaller = [bucket for bucket, k in self.changes if k == kind and bucket <= b]
        return max(0.0, self.changes[(max(smaller), kind)]) if smaller else 0.0

    def _added(self, bucket: int, k: int) -> float:
        """What serving added to the prior in the nearest measured entry of k's kind (plain or
        round): the same bucket first, then the nearest bucket (the smaller on a tie), then the
        nearest draft length; 0 where none of its kind was measured."""
        if (bucket, k) not in self._nearest:
            i = self.buckets.index(bucket)
            same_kind = [
                (abs(self.buckets.index(b) - i), b > bucket, abs(j - k), (b, j))
                for b, j in self.measured
                if (j == 0) == (k == 0) and (b, j) in self.prior
            ]
            self._nearest[(bucket, k)] = min(same_kind)[-1] if same_kind else None
        key = self._nearest[(bucket, k)]
        return 0.0 if key is None else max(0.0, self._figure(key) - self.prior[key])

    def _average(self, table: dict, key: tuple, seconds: float) -> None:
        old = table.get(key)
        table[key] = seconds if old is None else old + self.weight * (seconds - old)

    def _check(self, k: int, seconds: float) -> None:
        if not 0 <= k <= self.num_steps:
            raise ValueError(f"cost model: draft length {k} outside 0..{self.num_steps}")
        if not seconds > 0.0:
            raise ValueError(f"cost model: a step must take a positive time, got {seconds} s")
