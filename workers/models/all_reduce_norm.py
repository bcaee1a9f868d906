"""A row-parallel projection's all-reduce, the residual add and the RMSNorm after it, in one
Triton kernel a rank, over peer memory (decode-sized messages, `TPGroup.all_reduce_add_rms_norm`);
the same kernel without the add and norm is the group's all-reduce of such messages
(`TPGroup.all_reduce`), and a kernel of the same kind its all-gather (`TPGroup.all_gather`: the
LM head's vocabulary shards).

A tensor-parallel decode step all-reduces each layer's attention and MLP outputs and adds each to
the residual stream before normalising it: a collective kernel, then an add + norm kernel, twice
a layer. Here one kernel does both, as SGLang's and vLLM's fused custom all-reduces do. Each
program owns rows `pid, pid + programs, ...`; it pushes them into its slot of every rank's
buffer in symmetric memory (`TPGroup.use_one_shot_all_reduce`), then reads every rank's slot of
its own buffer, sums them in float32 in rank order (every rank gets the same bits) and rounds the
sum to the model's dtype, as an all-reduce returns it; then what `add_rms_norm` does with it
(`workers/models/ops.py`): the bias, a sandwich norm's first norm, the residual add in the model's
dtype, Gemma 4's layer scalar, the norm, rounded as Hugging Face rounds (`sandwich_norm.py`).

No barrier: the buffer's empty elements hold negative zero, which no pushed element does (a
pushed -0.0 becomes +0.0: the same sum), so a reader polls its own memory until no element of
a slot is empty (each element is stored whole), as TensorRT-LLM's Lamport all-reduce does; one
one-way trip over NVLink instead of two meetings of round trips. A reader empties its slots as
it reads them. The slots alternate between two generations, so that a fast peer's next call
pushes where this call's reads cannot see it; a peer can run at most one call ahead (each call
waits for every rank's push), and a rank's pushes of its next call come after its emptying of
this one (kernel order). The generation lives on the device (`state`: the generation and how
many programs have finished), flipped by the call's last program, so a CUDA graph replays the
kernel as captured.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from attention.kernels.launch import pdl_options, pdl_start
from workers.models.sandwich_norm import normed


@triton.jit
def empty_slot(x, BITS: tl.constexpr):
    """Where `x` holds the empty marker, negative zero (only the sign bit set)."""
    if BITS == 16:
        return x.to(tl.int16, bitcast=True) == -32768
    else:
        return x.to(tl.int32, bitcast=True) == -2147483648


@triton.jit
def empty_marker(dtype, BITS: tl.constexpr, BLOCK: tl.constexpr):
    """A block of empty markers in `dtype`."""
    if BITS == 16:
        return tl.full([BLOCK], -32768, tl.int16).to(dtype, bitcast=True)
    else:
        return tl.full([BLOCK], -2147483648, tl.int32).to(dtype, bitcast=True)


@triton.jit
def push(src, mask, buffers, offsets, dtype, WORLD: tl.constexpr, BITS: tl.constexpr):
    """Store the block at `src` at `offsets` of every rank's buffer (a -0.0 as +0.0: never empty)."""
    x = tl.load(src, mask=mask, other=0.0)
    x = tl.where(empty_slot(x, BITS), tl.zeros_like(x), x)
    for peer in tl.static_range(WORLD):
        theirs = tl.load(buffers + peer).to(tl.pointer_type(dtype))
        tl.store(theirs + offsets, x, mask=mask)


@triton.jit
def take(at, mask, empty, BITS: tl.constexpr):
    """The block a peer pushed at `at`, once no element of it is empty; the block emptied after."""
    got = tl.load(at, mask=mask, other=0.0, volatile=True)
    while tl.sum((empty_slot(got, BITS) & mask).to(tl.int32), axis=0) > 0:
        got = tl.load(at, mask=mask, other=0.0, volatile=True)
    tl.store(at, empty, mask=mask)
    return got


@triton.jit
def finish_call(state, generation):
    """Count this program finished; the call's last one moves the rank to the other generation."""
    tl.debug_barrier()  # every thread of the program is done before it counts itself finished
    if tl.atomic_add(state + 1, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        tl.store(state + 1, 0)
        tl.store(state, 1 - generation)


@triton.jit
def _all_reduce_add_rms_norm_kernel(
    x_ptr,
    res_ptr,
    out_ptr,
    w_ptr,
    w_before_ptr,
    bias_ptr,
    scale_ptr,
    buffers,
    state,
    rows,
    size,
    eps,
    stride_res,
    slot_size,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    NORM: tl.constexpr,
    GEMMA: tl.constexpr,
    BEFORE: tl.constexpr,
    BIAS: tl.constexpr,
    SCALE: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < size
    dtype = out_ptr.dtype.element_ty
    generation = tl.load(state)
    pushed = (generation * WORLD + RANK) * slot_size
    for row in range(pid, rows, programs):
        push(x_ptr + row * size + cols, mask, buffers, pushed + row * size + cols, dtype, WORLD, BITS)
    mine = tl.load(buffers + RANK).to(tl.pointer_type(dtype))
    empty = empty_marker(dtype, BITS, BLOCK)
    if NORM:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    for row in range(pid, rows, programs):
        total = tl.zeros([BLOCK], tl.float32)
        for peer in tl.static_range(WORLD):
            at = mine + (generation * WORLD + peer) * slot_size + row * size + cols
            total += take(at, mask, empty, BITS).to(tl.float32)
        x = total.to(dtype)
        if NORM:
            if BIAS:
                x = (x.to(tl.float32) + tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)).to(dtype)
            if BEFORE:
                w_before = tl.load(w_before_ptr + cols, mask=mask, other=0.0)
                x = normed(x.to(tl.float32), w_before, mask, eps, size, GEMMA, dtype)
            res = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
            res = (res.to(tl.float32) + x.to(tl.float32)).to(dtype)
            if SCALE:
                res = (res.to(tl.float32) * tl.load(scale_ptr).to(dtype).to(tl.float32)).to(dtype)
            tl.store(res_ptr + row * stride_res + cols, res, mask=mask)
            normed_res = normed(res.to(tl.float32), w, mask, eps, size, GEMMA, dtype)
            tl.store(out_ptr + row * size + cols, normed_res, mask=mask)
        else:  # the all-reduce alone
            tl.store(out_ptr + row * size + cols, x, mask=mask)
    finish_call(state, generation)


@triton.jit
def _all_gather_kernel(
    x_ptr,
    out_ptr,
    buffers,
    state,
    n,
    shard,
    slot_size,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[r, s * shard + c] = rank s's x[r, c]: each program pushes its blocks of this rank's
    `n` elements into its slot of every rank's buffer, then copies every rank's slot of its own
    buffer into place, as the all-reduce does (same markers, slots and generations)."""
    pdl_start(PDL)
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    dtype = out_ptr.dtype.element_ty
    generation = tl.load(state)
    pushed = (generation * WORLD + RANK) * slot_size
    for start in range(pid * BLOCK, n, step):
        at = start + tl.arange(0, BLOCK)
        inside = at < n
        push(x_ptr + at, inside, buffers, pushed + at, dtype, WORLD, BITS)
    mine = tl.load(buffers + RANK).to(tl.pointer_type(dtype))
    empty = empty_marker(dtype, BITS, BLOCK)
    for start in range(pid * BLOCK, n, step):
        at = start + tl.arange(0, BLOCK)
        inside = at < n
        row, col = at // shard, at % shard
        for peer in tl.static_range(WORLD):
            got = take(mine + (generation * WORLD + peer) * slot_size + at, inside, empty, BITS)
            tl.store(out_ptr + row * (WORLD * shard) + peer * shard + col, got, mask=inside)
    finish_call(state, generation)


GATHER_BLOCK = 1024  # elements a program moves at a time


@dataclasses.dataclass(frozen=True)
class PushGroup:
    """What a rank's kernel needs of its group: every rank's push buffer address (int64; each
    buffer two generations of `world` slots of `slot_size` elements, emptied by
    `empty_push_buffer` before first use), this rank's generation state (int32 [generation,
    finished programs], zeros at first), its rank, the group's size and the most programs."""

    buffers: torch.Tensor
    state: torch.Tensor
    slot_size: int
    rank: int
    world: int
    programs: int


def all_reduce_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    gemma: bool,
    before: torch.Tensor | None,
    bias: torch.Tensor | None,
    group: PushGroup,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual'), residual') with residual' = (residual + x') * scale, x' the sum of
    every rank's `x` (plus `bias`, through the `before` norm when given; no scale: 1), over the
    last dimension; the residual is updated in place. `x` and `residual` are contiguous, `x` at
    most a slot. Every rank calls it (and `all_reduce`) with the same shapes, in the same order."""
    res2 = residual.view(-1, x.shape[-1])
    out = _launch(x, group, True, res2, weight, eps, gemma, before, bias, scale)
    return out, residual


def all_reduce(x: torch.Tensor, group: PushGroup) -> torch.Tensor:
    """The sum of every rank's `x` (contiguous, at most a slot), rounded to its dtype."""
    return _launch(x, group, False, x.view(-1, x.shape[-1]), x, 0.0, False, None, None)


def all_gather(x: torch.Tensor, group: PushGroup) -> torch.Tensor:
    """Every rank's `x` (contiguous, `[rows, shard]`, at most a slot) side by side along the
    last dimension, rank order: `[rows, world * shard]`. A -0.0 arrives as +0.0."""
    rows, shard = x.shape
    out = torch.empty(rows, group.world * shard, dtype=x.dtype, device=x.device)
    grid = min(triton.cdiv(x.numel(), GATHER_BLOCK), group.programs)
    if grid:
        _all_gather_kernel[(grid,)](
            x,
            out,
            group.buffers,
            group.state,
            x.numel(),
            shard,
            group.slot_size,
            RANK=group.rank,
            WORLD=group.world,
            BITS=8 * x.element_size(),
            BLOCK=GATHER_BLOCK,
            num_warps=4,
            **pdl_options(grid),
        )
    return out


def _launch(
    x: torch.Tensor,
    group: PushGroup,
    norm: bool,
    res2: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    gemma: bool,
    before: torch.Tensor | None,
    bias: torch.Tensor | None,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    size = x.shape[-1]
    x2 = x.view(-1, size)
    out = torch.empty_like(x)
    rows = x2.shape[0]
    if rows:
        block = triton.next_power_of_2(size)
        grid = min(rows, group.programs)
        _all_reduce_add_rms_norm_kernel[(grid,)](
            x2,
            res2,
            out,
            weight,
            weight if before is None else before,
            weight if bias is None else bias,
            weight if scale is None else scale,
            group.buffers,
            group.state,
            rows,
            size,
            eps,
            res2.stride(0),
            group.slot_size,
            RANK=group.rank,
            WORLD=group.world,
            NORM=norm,
            GEMMA=gemma,
            BEFORE=before is not None,
            BIAS=bias is not None,
            SCALE=scale is not None,
            BITS=8 * x.element_size(),
            BLOCK=block,
            num_warps=min(16, max(1, block // 256)),
            **pdl_options(grid),
        )
    return out


def empty_push_buffer(buffer: torch.Tensor) -> None:
    """Mark every element empty (negative zero: only the sign bit set)."""
    bits = {2: torch.int16, 4: torch.int32}[buffer.element_size()]
    buffer.view(bits).fill_(torch.iinfo(bits).min)
