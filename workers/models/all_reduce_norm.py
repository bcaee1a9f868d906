"""A row-parallel projection's all-reduce, the residual add and the RMSNorm after it, in one
Triton kernel a rank, over peer memory (decode-sized messages, `TPGroup.all_reduce_add_rms_norm`).

A tensor-parallel decode step all-reduces each layer's attention and MLP outputs and adds each to
the residual stream before normalising it: a collective kernel, then an add + norm kernel, twice
a layer. Here one kernel does both, as SGLang's and vLLM's fused custom all-reduces do. Each
program owns rows `pid, pid + programs, ...`: it copies them into this rank's buffer in symmetric
memory (`TPGroup.use_one_shot_all_reduce`), meets the same program of every peer (`meet`), reads
the rows from every rank's buffer, sums them in float32 in rank order (every rank gets the same
bits) and rounds the sum to the model's dtype, as an all-reduce returns it; then what
`add_rms_norm` does with it (`workers/models/ops.py`): the bias, a sandwich norm's first norm, the
residual add in the model's dtype, the norm, rounded as Hugging Face rounds (`sandwich_norm.py`).
A second meeting at the end keeps a rank from overwriting its buffer (its next call) while a peer
still reads it.

The meetings use torch's signal pads: one 32-bit slot a (program, peer) pair on every rank,
`channel` slots apart for the two meetings. A program sets its slot on each peer's pad (0 -> 1,
waiting while the peer has not yet taken the last signal) with release semantics, then takes each
peer's slot on its own pad (1 -> 0) with acquire semantics, at system scope, as torch's own
symmetric-memory kernels do (`sync_remote_blocks`). The slots end as they began, zero, so a
CUDA graph replays the kernel as captured; the ranks launch the same grid, so program ids pair up.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention.kernels.launch import pdl_options, pdl_start
from workers.models.sandwich_norm import normed


@triton.jit
def meet(pads, slot, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Wait until the program holding `slot` on every peer has come here too: what this program
    wrote before is then visible to theirs, and what theirs wrote to this one (`pads`: each rank's
    signal pad address)."""
    tl.debug_barrier()  # every thread's writes happen before the release
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            theirs = tl.load(pads + peer).to(tl.pointer_type(tl.int32))
            while tl.atomic_cas(theirs + slot * WORLD + RANK, 0, 1, sem="release", scope="sys") != 0:
                pass
    mine = tl.load(pads + RANK).to(tl.pointer_type(tl.int32))
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            while tl.atomic_cas(mine + slot * WORLD + peer, 1, 0, sem="acquire", scope="sys") != 1:
                pass
    tl.debug_barrier()  # every thread's reads happen after the acquire


@triton.jit
def _all_reduce_add_rms_norm_kernel(
    x_ptr,
    res_ptr,
    out_ptr,
    w_ptr,
    w_before_ptr,
    bias_ptr,
    buffers,
    pads,
    rows,
    size,
    eps,
    stride_res,
    channel,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    GEMMA: tl.constexpr,
    BEFORE: tl.constexpr,
    BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < size
    dtype = out_ptr.dtype.element_ty
    mine = tl.load(buffers + RANK).to(tl.pointer_type(dtype))
    for row in range(pid, rows, programs):
        tl.store(mine + row * size + cols, tl.load(x_ptr + row * size + cols, mask=mask), mask=mask)
    meet(pads, pid, RANK, WORLD)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    for row in range(pid, rows, programs):
        total = tl.zeros([BLOCK], tl.float32)
        for peer in tl.static_range(WORLD):
            theirs = tl.load(buffers + peer).to(tl.pointer_type(dtype))
            total += tl.load(theirs + row * size + cols, mask=mask, other=0.0).to(tl.float32)
        x = total.to(dtype)
        if BIAS:
            x = (x.to(tl.float32) + tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)).to(dtype)
        if BEFORE:
            w_before = tl.load(w_before_ptr + cols, mask=mask, other=0.0)
            x = normed(x.to(tl.float32), w_before, mask, eps, size, GEMMA, dtype)
        res = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        res = (res.to(tl.float32) + x.to(tl.float32)).to(dtype)
        tl.store(res_ptr + row * stride_res + cols, res, mask=mask)
        tl.store(out_ptr + row * size + cols, normed(res.to(tl.float32), w, mask, eps, size, GEMMA, dtype), mask=mask)
    meet(pads, channel + pid, RANK, WORLD)


def all_reduce_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    gemma: bool,
    before: torch.Tensor | None,
    bias: torch.Tensor | None,
    buffers: torch.Tensor,
    pads: torch.Tensor,
    rank: int,
    world: int,
    channel: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual'), residual') with residual' = residual + x', x' the sum of every rank's
    `x` (plus `bias`, through the `before` norm when given), over the last dimension; the residual
    is updated in place. `x` and `residual` are contiguous; `buffers` and `pads` hold every rank's
    buffer and signal pad address (int64), the buffer at least `x`'s size; at most `channel`
    programs, whose slots (`2 * channel * world`) the pads hold. Every rank calls it with the same
    shapes."""
    size = x.shape[-1]
    x2, res2 = x.view(-1, size), residual.view(-1, size)
    out = torch.empty_like(x)
    rows = x2.shape[0]
    if rows:
        block = triton.next_power_of_2(size)
        programs = min(rows, channel)
        _all_reduce_add_rms_norm_kernel[(programs,)](
            x2,
            res2,
            out,
            weight,
            weight if before is None else before,
            weight if bias is None else bias,
            buffers,
            pads,
            rows,
            size,
            eps,
            res2.stride(0),
            channel,
            RANK=rank,
            WORLD=world,
            GEMMA=gemma,
            BEFORE=before is not None,
            BIAS=bias is not None,
            BLOCK=block,
            num_warps=min(16, max(1, block // 256)),
            **pdl_options(programs),
        )
    return out, residual
