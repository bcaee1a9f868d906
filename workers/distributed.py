"""The tensor-parallel group a rank's layers communicate through.

With `size == 1` every collective is the identity, so single-rank code pays nothing; a
`torch.distributed` process group (gloo on CPU, NCCL on GPU) is passed in for `size > 1`.

All-reduces of decode-sized messages are latency-bound: NCCL's ring costs ~20 us each on two
NVLink-connected H200s, and a decode step has two a layer. `use_one_shot_all_reduce` routes
messages up to `ONE_SHOT_MAX_BYTES` through peer memory instead (torch's symmetric memory: every
rank copies its input into a buffer its peers can read, then one kernel reads all copies and
sums them), as vLLM's and SGLang's custom all-reduces do; larger messages (prefill) stay on NCCL.
Both paths can be captured in CUDA graphs.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch
import torch.distributed as dist

ONE_SHOT_MAX_BYTES = 1 << 20  # a batch of 128 hidden states of 4,096 in bf16
AllReduce = Literal["nccl", "one_shot"]


@dataclasses.dataclass
class TPGroup:
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    _peer_buffer: torch.Tensor | None = dataclasses.field(default=None, init=False, repr=False)
    _peer_group: str = dataclasses.field(default="", init=False, repr=False)  # its rendezvous group's name

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tp rank {self.rank} outside a group of size {self.size}")
        if self.size > 1 and not dist.is_initialized():
            raise RuntimeError("tp_size > 1 needs torch.distributed initialised first")

    def use_one_shot_all_reduce(self, dtype: torch.dtype, device: torch.device) -> None:
        """Allocate and exchange the peer-readable buffer; collective: every rank calls it."""
        if self.size == 1:
            return
        if device.type != "cuda":
            raise ValueError(f"tp_all_reduce: 'one_shot' needs CUDA devices, not {device.type}")
        import torch.distributed._symmetric_memory as symm_mem

        self._peer_group = (self.group or dist.group.WORLD).group_name
        buffer = symm_mem.empty(ONE_SHOT_MAX_BYTES // dtype.itemsize, dtype=dtype, device=device)
        symm_mem.rendezvous(buffer, self._peer_group)
        self._peer_buffer = buffer

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        peer = self._peer_buffer
        if peer is not None and x.dtype == peer.dtype and x.numel() <= peer.numel() and x.is_contiguous():
            return torch.ops.symm_mem.one_shot_all_reduce_copy(
                peer[: x.numel()], x.view(-1), "sum", self._peer_group
            ).view_as(x)
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


SINGLE_RANK = TPGroup()
