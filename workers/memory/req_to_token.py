"""The request->token table: row r, column p holds the full-pool slot of request r's token at
position p. Backends read page tables and KV slots from its device copy (`table`); the host
copy (`host`) is the master the allocator writes (see `host_mirror.py`)."""

from __future__ import annotations

import numpy as np
import torch

from workers.memory.host_mirror import HostMirrored


class ReqToTokenPool:
    """Rows 0..max_requests-1 for requests, and one more, `padding_row`, never handed out: the
    padded rows of a CUDA graph read it (the allocator points it at its scratch pages)."""

    def __init__(self, max_requests: int, max_context_len: int, device: torch.device | str) -> None:
        self.max_requests = max_requests
        self.max_context_len = max_context_len
        self.padding_row = max_requests
        self._mirror = HostMirrored(np.zeros((max_requests + 1, max_context_len), dtype=np.int32), device)
        self.host = self._mirror.host
        self.table = self._mirror.tensor
        self._free_rows = list(range(max_requests - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int:
        if not self._free_rows:
            raise RuntimeError(f"req_to_token: all {self.max_requests} rows are in use")
        return self._free_rows.pop()

    def free(self, row: int) -> None:
        if row in self._free_rows or not 0 <= row < self.max_requests:
            raise RuntimeError(f"req_to_token: row {row} freed twice or out of range")
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: np.ndarray) -> None:
        """Slots of positions [start, start + len(slots)) of a request."""
        self.host[row, start : start + len(slots)] = slots
        base = row * self.max_context_len
        self._mirror.mark_range(base + start, base + start + len(slots))

    def write_many(self, rows: np.ndarray, positions: np.ndarray, slots: np.ndarray) -> None:
        """Slot `slots[i]` at position `positions[i]` of request row `rows[i]` (a batch's at once)."""
        self.host[rows, positions] = slots
        self._mirror.mark(rows * self.max_context_len + positions)

    def slots(self, row: int, start: int, end: int) -> np.ndarray:
        return self.host[row, start:end]

    def flush(self, needed: bool = True) -> None:
        self._mirror.flush(needed)

    def check_no_leak(self) -> None:
        if self.num_free != self.max_requests:
            raise AssertionError(f"req_to_token: {self.max_requests - self.num_free} rows still in use")
