"""The tensor-parallel group a rank's layers communicate through.

With `size == 1` every collective is the identity, so single-rank code pays nothing; a
`torch.distributed` process group (gloo on CPU, NCCL on GPU) is passed in for `size > 1`.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist


@dataclasses.dataclass
class TPGroup:
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tp rank {self.rank} outside a group of size {self.size}")
        if self.size > 1 and not dist.is_initialized():
            raise RuntimeError("tp_size > 1 needs torch.distributed initialised first")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


SINGLE_RANK = TPGroup()
