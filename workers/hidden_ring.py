"""Where the plain decode steps of a speculative engine keep the target hidden states that an EAGLE
head's catch-up reads: one device buffer that the target's greedy decode graph writes in place.

Between speculative rounds an EAGLE head falls a token behind at every plain step and later
catches up from the target's hidden states of those steps (docs/design.md §6.1). A graph leaves
them in a static buffer that its next replay overwrites, and an overlapped plain step launches
the next replay before it commits its own, so each step's rows had to be copied out on the
host's side of the step (an allocation and a copy launched per step: on a host-bound model, a
few percent of a step). Here the graph itself writes its rows into this ring, at rows staged
with its inputs (`CudaGraphRunner`), so a kept step costs the host nothing.

Rows are numbered on from 0 (`take`); number n lives at row n % capacity. A step's rows are one
contiguous slice (a step that would wrap starts at row 0 instead), so a step's hidden states are
a view of the ring, valid until its rows are released after the catch-up that read them. Padded
rows of a graph write the row past the last (`scratch`), which nothing reads.
"""

from __future__ import annotations

import torch


class HiddenRing:
    def __init__(self, capacity: int, width: int, dtype: torch.dtype, device: torch.device) -> None:
        self.capacity = capacity
        self.scratch = capacity  # the row padded rows write
        self._use(torch.zeros(capacity + 1, width, dtype=dtype, device=device))
        self.head = 0  # the number of the next row taken
        self.tail = 0  # the first row not yet released
        self._taken: list[tuple[int, int]] = []  # (first row, rows) of the steps taken and not yet kept
        self._kept_end = 0  # the row after the last kept step's

    def match(self, hidden: torch.Tensor) -> None:
        """Take the dtype and width of the hidden states the graph writes (before its first
        write: a capture's warm-up forward shows them)."""
        if (hidden.dtype, hidden.shape[-1]) != (self.buffer.dtype, self.buffer.shape[-1]):
            if self.head:
                raise RuntimeError(f"hidden ring: {tuple(hidden.shape)} {hidden.dtype} rows after rows were kept")
            self._use(hidden.new_zeros(self.capacity + 1, hidden.shape[-1]))

    def _use(self, buffer: torch.Tensor) -> None:
        """Make `buffer` the ring, with the address range `row_of` compares against."""
        self.buffer = buffer
        self._base, self._row_bytes = buffer.data_ptr(), buffer.stride(0) * buffer.element_size()
        self._end = self._base + buffer.numel() * buffer.element_size()

    @property
    def free(self) -> int:
        return self.capacity - (self.head - self.tail)

    def take(self, rows: int) -> int:
        """The ring row where a step of `rows` requests writes its first hidden state (its
        others follow); raises when fewer rows are free (the speculative worker catches up
        before that: `SpecWorker.after_plain`)."""
        first = self.head
        if first % self.capacity + rows > self.capacity:  # no step wraps: it starts at row 0
            first += self.capacity - first % self.capacity
        if first + rows - self.tail > self.capacity:
            raise RuntimeError(
                f"hidden ring: {rows} rows for a step, {self.free} of {self.capacity} free "
                "(the draft should have caught up before)"
            )
        self.head = first + rows
        self._taken.append((first, rows))
        return first % self.capacity

    def keep(self, hidden: torch.Tensor | None) -> bool:
        """The oldest step taken and not yet kept is held now (steps are held in the order they
        took rows) with `hidden`, its hidden states as its forward left them: whether they are
        the ring rows it took (a graph wrote them: a view, nothing to copy) rather than an eager
        forward's own tensor. Its rows, and every earlier step's, are the ones the next
        `release` frees."""
        start = self.row_of(hidden)
        for i, (first, rows) in enumerate(self._taken):  # (a step whose forward failed was never kept)
            if start is None or (first % self.capacity == start and rows == hidden.shape[0]):
                self._kept_end = first + rows
                del self._taken[: i + 1]
                return start is not None
        return False

    def row_of(self, hidden: torch.Tensor | None) -> int | None:
        """The ring row where `hidden` starts, when it is a view of the ring (None otherwise)."""
        address = hidden.data_ptr() if hidden is not None else None
        if address is None or not self._base <= address < self._end:  # (one address a step: no storage objects)
            return None
        return (address - self._base) // self._row_bytes

    def release(self) -> None:
        """Free the rows of every kept step (a catch-up read them); a step taken since keeps its."""
        self.tail = max(self.tail, self._kept_end)
