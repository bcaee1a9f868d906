"""A table the host owns and the device mirrors.

The allocator's tables (request -> token slots, full -> SWA slots) are read and written on the
host at every step; reading a device tensor from the host would stop the GPU's queue, and
writing it entry by entry would cost a launch each. So the host copy (numpy) is the master,
writes mark their entries, and `flush()` brings the device copy up to date with one copy and
one scatter before the next forward that reads it (forwards that take everything from the host,
most decode steps, leave the marks to accumulate, up to `DEFERRED_ENTRIES`). On the CPU both are
the same memory.
"""

from __future__ import annotations

import numpy as np
import torch

DEFERRED_ENTRIES = 1 << 16  # marked entries a flush that is not needed yet may leave pending


class HostMirrored:
    def __init__(self, host: np.ndarray, device: torch.device | str) -> None:
        self.host = host
        self.device = torch.device(device)
        self.shared = self.device.type == "cpu"
        self.tensor = torch.from_numpy(host) if self.shared else torch.from_numpy(host).to(self.device)
        self._dirty: list[np.ndarray] = []  # flat indices written since the last flush
        self._pending = 0  # their total size

    def mark(self, flat: np.ndarray) -> None:
        """Entries (flat indices into the host array) were written."""
        if not self.shared and flat.size:
            self._dirty.append(flat)
            self._pending += flat.size

    def mark_range(self, start: int, end: int) -> None:
        if not self.shared and end > start:
            self.mark(np.arange(start, end, dtype=np.int64))

    def flush(self, needed: bool = True) -> None:
        """Copy the marked entries to the device copy (one host-to-device copy, one scatter);
        `needed=False` (the next forward does not read the device copy) defers it while few
        entries are pending."""
        if not self._dirty or (not needed and self._pending < DEFERRED_ENTRIES):
            return
        flat = np.concatenate(self._dirty)
        self._dirty, self._pending = [], 0
        packed = np.stack([flat, self.host.reshape(-1)[flat].astype(np.int64)])
        moved = torch.from_numpy(packed).pin_memory().to(self.device, non_blocking=True)
        self.tensor.view(-1)[moved[0]] = moved[1].to(self.tensor.dtype)
