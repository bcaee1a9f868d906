"""Static device buffers that one host-to-device copy fills before each graph replay.

A captured graph reads its inputs and attention metadata from fixed addresses, rewritten before
every replay. Written one buffer at a time that is a copy each (a batch's inputs, its lengths
and page tables, its SWA write slots, a verify mask), and on the device every copy outside the
graph costs a few microseconds of idle time between replays. Here the buffers are regions of
one device block: a replay writes what it needs into a pinned host block of the same layout
and `upload` copies the written prefix in one go. Regions are laid out in the order they were
added, so owners put the small, always-written ones first.

Host blocks are kept and reused, each with a typed view of every region made once (a fresh
block and its views for every replay were tens of microseconds of a host-bound step); a block is
reused only once the copy that read it has run (on a GPU, an event recorded after the copy says
so), so the host may stage the next replays while the device still has this one queued.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import torch

ALIGN = 16  # bytes: every region starts here, so any dtype's view of it is aligned
MAX_HOST_BLOCKS = 8  # host blocks kept; past them, staging waits for the oldest block's copy


@dataclasses.dataclass(frozen=True)
class Region:
    offset: int  # bytes into the block
    numel: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclasses.dataclass
class _HostBlock:
    """A host block of the device block's layout: its bytes, each region's elements as a typed
    array, and (on a GPU) the event after the copy that last read it."""

    tensor: torch.Tensor
    typed: dict[str, np.ndarray]
    copied: torch.cuda.Event | None = None

    def free(self) -> bool:
        """Whether no copy reading it is still queued."""
        return self.copied is None or self.copied.query()


class StagedBuffers:
    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.regions: dict[str, Region] = {}
        self.size = 0
        self.block: torch.Tensor | None = None  # the device block, once allocated
        self._views: dict[str, torch.Tensor] = {}  # each region's device view, made once
        self._numpy: dict[str, np.dtype] = {}  # each region's dtype on the host
        self._host: _HostBlock | None = None  # the host block of the replay being staged
        self._spare: collections.deque[_HostBlock] = collections.deque()  # host blocks not in use, oldest first
        self._blocks = 0  # host blocks made
        self._end = 0  # bytes of the host block written so far (the prefix `upload` copies)

    def add(self, name: str, numel: int, dtype: torch.dtype) -> None:
        """Reserve a region (before `allocate`)."""
        if self.block is not None:
            raise RuntimeError(f"staged buffers: region {name!r} added after allocation")
        if name in self.regions:
            raise ValueError(f"staged buffers: region {name!r} added twice")
        region = self.regions[name] = Region(self.size, numel, dtype)
        self._numpy[name] = torch.empty(0, dtype=dtype).numpy().dtype
        self.size += -(-region.nbytes // ALIGN) * ALIGN

    def allocate(self) -> None:
        self.block = torch.zeros(max(self.size, ALIGN), dtype=torch.uint8, device=self.device)
        self._views.clear()

    def view(self, name: str) -> torch.Tensor:
        """The device region (fixed address: graphs capture it)."""
        view = self._views.get(name)
        if view is None:
            region = self.regions[name]
            view = self._views[name] = self._slice(self.block, region).view(region.dtype)
        return view

    @property
    def open(self) -> bool:
        """Whether a replay is being staged (between `begin` and `upload`)."""
        return self._host is not None

    def begin(self) -> None:
        """Start staging a replay's buffers, in the oldest host block whose copy has run (a new
        one while fewer than MAX_HOST_BLOCKS were made; past them, the oldest once its copy ran)."""
        spare = self._spare
        if spare and spare[0].free():
            self._host = spare.popleft()
        elif spare and self._blocks >= MAX_HOST_BLOCKS:  # the device is that many replays behind: wait
            self._host = spare.popleft()
            self._host.copied.synchronize()
        else:
            self._host = self._new_host_block()
        self._end = 0

    def _new_host_block(self) -> _HostBlock:
        pinned = self.device.type == "cuda"
        tensor = torch.empty(self.block.numel(), dtype=torch.uint8, pin_memory=pinned)
        data = tensor.numpy()
        typed = {
            name: data[region.offset : region.offset + region.nbytes].view(self._numpy[name])
            for name, region in self.regions.items()
        }
        self._blocks += 1
        return _HostBlock(tensor, typed, torch.cuda.Event() if pinned else None)

    def put(self, name: str, values: np.ndarray, at: int = 0) -> torch.Tensor:
        """Stage `values` at element `at` of a region; the device view of those elements (valid
        once uploaded)."""
        n = values.size
        self.host(name, n, at)[:] = values.reshape(-1)
        view = self.view(name)
        return view if n == self.regions[name].numel else view[at : at + n]

    def host(self, name: str, n: int, at: int = 0) -> np.ndarray:
        """The host memory of `n` elements of a region from element `at`, staged: written in
        place by the caller, uploaded with the rest (no array of its own, no device view made,
        for regions a graph reads and the host does not)."""
        if self._host is None:
            raise RuntimeError(f"staged buffers: {name!r} staged outside begin()/upload()")
        region = self.regions[name]
        if at + n > region.numel:
            raise ValueError(f"staged buffers: {at + n} elements for region {name!r} of {region.numel}")
        end = region.offset + (at + n) * region.dtype.itemsize
        if end > self._end:
            self._end = end
        return self._host.typed[name][at : at + n]

    def upload(self) -> None:
        """Copy everything staged since `begin` to the device, in one copy."""
        host, self._host = self._host, None
        if host is None:
            raise RuntimeError("staged buffers: upload() without begin()")
        if self._end:
            self.block[: self._end].copy_(host.tensor[: self._end], non_blocking=True)
            if host.copied is not None:
                host.copied.record()
        self._spare.append(host)

    @staticmethod
    def _slice(block: torch.Tensor, region: Region) -> torch.Tensor:
        return block[region.offset : region.offset + region.nbytes]
