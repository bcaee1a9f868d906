"""The tensor-parallel group a rank's layers communicate through.

With `size == 1` every collective is the identity, so single-rank code pays nothing; a
`torch.distributed` process group (gloo on CPU, NCCL on GPU) is passed in for `size > 1`.

All-reduces of decode-sized messages are latency-bound: NCCL's ring costs ~20 us each on two
NVLink-connected H200s, and a decode step has two a layer. `use_one_shot_all_reduce` routes
small messages through peer memory instead (a buffer in torch's symmetric memory on every rank:
one kernel pushes this rank's rows into every rank's buffer and sums what every rank pushed into
its own; `workers/models/all_reduce_norm.py`), as vLLM's and SGLang's custom all-reduces do;
larger messages (prefill) stay on NCCL. Most of those all-reduces are followed by the residual
add and an RMSNorm (`all_reduce_add_rms_norm`), which the same kernel then does too. Which path
a message takes is the size table `ONE_SHOT_METHODS`. Every path can be captured in CUDA graphs.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # the models' module imports this one, and Triton
    from workers.models.all_reduce_norm import PushGroup

AllReduce = Literal["nccl", "one_shot"]
Method = Literal["one_shot_fused", "one_shot", "nccl"]

# How a message of up to so many bytes is all-reduced once peer memory is set up (`tp_all_reduce:
# one_shot`): the first row that holds it decides; larger ones, and every message without peer
# memory, take "nccl", the process group's own all-reduce (NCCL; gloo on CPU), then the add and
# norm apart. "one_shot_fused": the push kernel that also adds the residual and normalises
# (`all_reduce_add_rms_norm`; a plain all-reduce takes the next row); "one_shot": the push
# kernel alone.
ONE_SHOT_METHODS: tuple[tuple[int, Method], ...] = (
    (1 << 20, "one_shot_fused"),  # a batch of 128 hidden states of 4,096 in bf16
    (1 << 20, "one_shot"),
)
PEER_BUFFER_BYTES = max(bound for bound, _ in ONE_SHOT_METHODS)
FUSED_PROGRAMS = 64  # the most programs of the push kernel (each owns rows)
MAX_ROW = 16384  # the widest row the push kernel takes (one program holds a row)


@dataclasses.dataclass(frozen=True)
class PeerMemory:
    """This rank's push buffer in symmetric memory and what the kernels need of the group
    (`workers.models.all_reduce_norm.PushGroup`), set up by `TPGroup.use_one_shot_all_reduce`."""

    buffer: torch.Tensor
    group: PushGroup


@dataclasses.dataclass
class TPGroup:
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    # Whether `all_reduce_add_rms_norm` may run as one kernel (off: the all-reduce, then the add and
    # norm; `ops/bench/tensor_parallel.py` compares the two).
    fuse_norm: bool = True
    _peer: PeerMemory | None = dataclasses.field(default=None, init=False, repr=False)

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

        from workers.models.all_reduce_norm import PushGroup, empty_push_buffer

        slot_size = PEER_BUFFER_BYTES // dtype.itemsize
        buffer = symm_mem.empty(2 * self.size * slot_size, dtype=dtype, device=device)
        handle = symm_mem.rendezvous(buffer, (self.group or dist.group.WORLD).group_name)
        empty_push_buffer(buffer)
        torch.cuda.synchronize(device)
        dist.barrier(group=self.group)  # every rank's buffer empty before any peer pushes
        pointers = torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device)
        state = torch.zeros(2, dtype=torch.int32, device=device)
        self._peer = PeerMemory(buffer, PushGroup(pointers, state, slot_size, self.rank, self.size, FUSED_PROGRAMS))

    def method(self, x: torch.Tensor, then_norm: bool = False) -> Method:
        """How `x` is all-reduced (`then_norm`: by `all_reduce_add_rms_norm`)."""
        if not self._peer_takes(x) or x.shape[-1] > MAX_ROW:
            return "nccl"
        fused = then_norm and self.fuse_norm
        nbytes = x.numel() * x.element_size()
        for bound, method in ONE_SHOT_METHODS:
            if nbytes <= bound and (fused or method != "one_shot_fused"):
                return method
        return "nccl"

    def _peer_takes(self, x: torch.Tensor) -> bool:
        """Whether peer memory is set up for `x`'s dtype and `x` is contiguous."""
        return self._peer is not None and x.dtype == self._peer.buffer.dtype and x.is_contiguous()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x` (NCCL sums in place: `x` is the result)."""
        if self.size == 1:
            return x
        if self.method(x) == "one_shot":
            from workers.models.all_reduce_norm import all_reduce

            return all_reduce(x, self._peer.group)
        dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_add_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        gemma: bool,
        before: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        scale: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`add_rms_norm(all_reduce(x) + bias, residual, weight, eps, gemma, before, scale)` of
        the op set (`workers/models/ops.py`): (rms_norm(residual'), residual') with residual' =
        (residual + x') * scale, x' the all-reduced `x` plus `bias`, passed through the `before`
        norm (Gemma's sandwich) when given, `scale` Gemma 4's layer scalar or None. One kernel
        where `method` says "one_shot_fused" (the residual updated in place); else the
        all-reduce, then the op set's add and norm."""
        # imported here: the models import this module
        if self.method(x, then_norm=True) == "one_shot_fused" and residual.is_contiguous():
            from workers.models.all_reduce_norm import all_reduce_add_rms_norm

            return all_reduce_add_rms_norm(x, residual, weight, eps, gemma, before, bias, self._peer.group, scale)
        from workers.models.ops import ops_for

        x = self.all_reduce(x)
        if bias is not None:
            x = x + bias
        return ops_for(x).add_rms_norm(x, residual, weight, eps, gemma, before, scale)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x` concatenated along `dim`, in rank order: through peer memory for a
        decode-sized contiguous `[rows, shard]` along the last dimension (the LM head's logits),
        else the process group's all-gather."""
        if self.size == 1:
            return x
        if (
            x.dim() == 2
            and dim in (-1, 1)
            and self._peer_takes(x)
            and x.numel() * x.element_size() <= PEER_BUFFER_BYTES
        ):
            from workers.models.all_reduce_norm import all_gather

            return all_gather(x, self._peer.group)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


SINGLE_RANK = TPGroup()


def join_tp_group(
    rank: int, size: int, init_method: str, device: str, timeout: datetime.timedelta, fuse_norm: bool = True
) -> tuple[TPGroup, dist.ProcessGroup | None]:
    """Join a replica's process group as `rank` of `size`: NCCL for the model's collectives on
    CUDA, gloo on CPU. Returns this rank's `TPGroup` and the gloo group rank 0's step plans are
    broadcast over (`RankLoop`'s; the whole group on CPU). Alone: no process group, and no plans
    to broadcast."""
    if size == 1:
        return SINGLE_RANK, None
    cuda = device == "cuda"
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=init_method, rank=rank, world_size=size, timeout=timeout
    )
    control = dist.new_group(backend="gloo", timeout=timeout) if cuda else dist.group.WORLD
    return TPGroup(rank, size, dist.group.WORLD, fuse_norm=fuse_norm), control


def leave_tp_group(control: dist.ProcessGroup | None, device: str) -> None:
    """Leave what `join_tp_group` joined once every rank is done: after a barrier (no rank closes
    its connections while another still reads from them), the group is destroyed on CPU. On CUDA
    it is left as is: NCCL's communicators are captured in the engine's graphs, which tearing them
    down would break; the process exits with them."""
    if control is None:
        return
    dist.barrier(group=control)
    if device != "cuda":
        dist.destroy_process_group()
