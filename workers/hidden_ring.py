"""Where the plain decode steps of a speculative engine keep the target hidden states that an EAGLE
head's catch-up reads: one device buffer that the target's greedy decode graph writes in place.

Between speculative rounds an EAGLE head falls a token behind at every plain step and later
catches up from the target's hidden states of those steps (docs/design.md §6.1). A graph leaves
them in a static buffer that its next replay overwrites, and an overlapped plain step launches
the next replay before it commits its own, so each step's rows had to be copied out on the
host's side of the step (an allocation and a copy launched per step: on a host-bound model, a
few percent of a step). Here the graph itself writes its rows into this ring, from the one row
number staged with its inputs (`CudaGraphRunner`), so a kept step costs the host a few integers.

Rows are numbered on from 0 (`take`); number n lives at row n % capacity. A step's rows are one
contiguous slice (a step that would wrap starts at row 0 instead), valid until they are released
after the catch-up that read them. A graph's padded rows follow its real ones: into rows the next
step takes (its replay, later on the same stream, writes them again) or, past the last row, into
`slack` rows that nothing reads; a step takes its rows only where that many more are free.
"""

from __future__ import annotations

import torch


class HiddenRing:
    def __init__(self, capacity: int, width: int, dtype: torch.dtype, device: torch.device, slack: int = 1) -> None:
        """`slack`: the most rows a graph writes for one step, padding included."""
        self.capacity = capacity
        self.slack = slack
        self.scratch = capacity  # where a replay given no rows writes them
        self.buffer = torch.zeros(capacity + slack, width, dtype=dtype, device=device)
        self.head = 0  # the number of the next row taken
        self.tail = 0  # the first row not yet released

    def match(self, hidden: torch.Tensor) -> None:
        """Take the dtype and width of the hidden states the graph writes (before its first
        write: a capture's warm-up forward shows them)."""
        if (hidden.dtype, hidden.shape[-1]) != (self.buffer.dtype, self.buffer.shape[-1]):
            if self.head:
                raise RuntimeError(f"hidden ring: {tuple(hidden.shape)} {hidden.dtype} rows after rows were taken")
            self.buffer = hidden.new_zeros(self.capacity + self.slack, hidden.shape[-1])

    @property
    def free(self) -> int:
        return self.capacity - (self.head - self.tail)

    @property
    def row_bytes(self) -> int:
        return self.buffer.shape[-1] * self.buffer.element_size()

    def row(self, number: int) -> int:
        """The buffer row of row number `number`."""
        return number % self.capacity

    def take(self, rows: int) -> int:
        """The number of the row where a step of `rows` requests writes its first hidden state
        (its others follow); raises when fewer rows are free, counting the `slack` rows a padded
        graph may write (the speculative worker catches up before that: `SpecWorker.after_plain`)."""
        first, capacity = self.head, self.capacity
        at = first % capacity
        if at + rows > capacity:  # no step wraps: it starts at row 0
            first, at = first + capacity - at, 0
        reach = rows if rows > self.slack else self.slack
        if at + reach > capacity:  # (padded rows past the last go to the slack)
            reach = capacity - at
        if first + reach - self.tail > capacity:
            raise RuntimeError(
                f"hidden ring: {rows} rows for a step (up to {max(rows, self.slack)} with padding), {self.free} "
                f"of {self.capacity} free (the draft should have caught up before)"
            )
        self.head = first + rows
        return first

    def view(self, first: int, rows: int) -> torch.Tensor:
        """The hidden states of the `rows` rows from number `first`."""
        at = self.row(first)
        return self.buffer[at : at + rows]

    def release(self, end: int) -> None:
        """Free every row before number `end`: a catch-up read the steps ending there (and a
        step whose forward failed, before them, was never read); a step taken after them keeps
        its own rows."""
        self.tail = max(self.tail, end)
