"""Few-row projections of FP8 weights on CUDA: the one-row GEMV family (`gemv.py`) reading e4m3
weights directly (docs/design.md §4.9).

At batch 1 to 8 a decode step's products are weight reads; FP8 weights halve their bytes only if
the kernel reads them as they are stored, so these kernels load FP8 tiles, widen them in
registers and multiply with the bf16 (or fp16) activations, accumulating in float32; nothing
quantises the activations. Scales apply as the layout says: a row's scale once on its sum (per
output channel), or each 128-column block's partial sum times its block's scale (per block: a
one-row tile spans whole blocks, its products summed block by block; a 2-to-8-row tile is one
block wide, each `tl.dot` scaled). The merged gate/up projection's variant computes both halves
and writes `act(gate) * up`. Tiles by weight shape and layout are data (`gemv_tiles.fp8_tile_for`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention.kernels.launch import pdl_options, pdl_start
from workers.models.fp8 import FP8
from workers.models.gemv import ACTIVATIONS, DOT_ROWS, _act, _store, _weight_tile
from workers.models.gemv_tiles import MAX_ROWS, Tile, fp8_tile_for

__all__ = ["ACTIVATIONS", "applies", "gemv", "gemv_act_and_mul"]

CHANNEL_SUM = 128  # per channel: the columns of a one-row tile summed together (a block's width)


@triton.jit
def _tile_sums(
    w,
    x_ptr,
    s_ptrs,
    k0,
    cols,
    groups,
    row_ok,
    K,
    BLOCK_N: tl.constexpr,
    GROUPS: tl.constexpr,
    SCALE_K: tl.constexpr,
    BLOCKED: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """A weight tile `w` against its columns of x, float32 `[BLOCK_N, GROUPS]`: the products
    summed over each SCALE_K columns, per block times the block's scale (per channel the rows'
    scales come after the loop). Summing inside the tile keeps the accumulator small: a
    full-width one (`[BLOCK_N, BLOCK_K]`) spills at the wide tiles FP8 rows want."""
    if EVEN_K:
        x = tl.load(x_ptr + k0 + cols)
    else:
        x = tl.load(x_ptr + k0 + cols, mask=(k0 + cols) < K, other=0.0)
    products = w.to(tl.float32) * x.to(tl.float32)[None, :]
    sums = tl.sum(tl.reshape(products, (BLOCK_N, GROUPS, SCALE_K)), axis=2)
    if BLOCKED:
        first = k0 // SCALE_K
        in_k = (first + groups) < tl.cdiv(K, SCALE_K)
        sums = sums * tl.load(s_ptrs + first, mask=row_ok[:, None] & in_k[None, :], other=0.0)
    return sums


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    y_ptr,
    N,
    K,
    s_stride,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,  # -1: a plain projection; else gate rows [0, N) and up rows [N, 2N) -> act(gate) * up
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUPS: tl.constexpr,  # scale blocks a K tile spans (BLOCK_K == GROUPS * SCALE_K)
    SCALE_N: tl.constexpr,  # the rows a block's scale covers (1 per channel)
    SCALE_K: tl.constexpr,  # the columns a block's scale covers (per channel: summed together)
    BLOCKED: tl.constexpr,  # a scale per block; else per output channel
    EVEN_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """W . x for one row of x, the weights' scales applied; with ACT, the gate's and the up
    projection's tiles read in the same iteration (two streams of loads in flight). The first K
    tile is loaded before the PDL wait (no kernel writes weights): it streams in while the
    kernel before finishes, so a short projection does not start from an empty pipeline."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    cols = tl.arange(0, BLOCK_K)
    groups = tl.arange(0, GROUPS)
    w_ptrs = w_ptr + rows[:, None].to(tl.int64) * K + cols[None, :]
    s_ptrs = s_ptr + (rows // SCALE_N).to(tl.int64)[:, None] * s_stride + groups[None, :]
    up_w_ptrs = w_ptrs + N.to(tl.int64) * K
    up_s_ptrs = s_ptr + ((rows + N) // SCALE_N).to(tl.int64)[:, None] * s_stride + groups[None, :]
    w = _weight_tile(w_ptrs, 0, cols, row_ok, K, EVEN_K)
    if ACT >= 0:
        up_w = _weight_tile(up_w_ptrs, 0, cols, row_ok, K, EVEN_K)
    else:
        up_w = w
    pdl_start(PDL)
    acc = _tile_sums(w, x_ptr, s_ptrs, 0, cols, groups, row_ok, K, BLOCK_N, GROUPS, SCALE_K, BLOCKED, EVEN_K)
    up_acc = acc
    if ACT >= 0:
        up_acc = _tile_sums(
            up_w, x_ptr, up_s_ptrs, 0, cols, groups, row_ok, K, BLOCK_N, GROUPS, SCALE_K, BLOCKED, EVEN_K
        )
    for k0 in range(BLOCK_K, K, BLOCK_K):
        w = _weight_tile(w_ptrs, k0, cols, row_ok, K, EVEN_K)
        acc += _tile_sums(w, x_ptr, s_ptrs, k0, cols, groups, row_ok, K, BLOCK_N, GROUPS, SCALE_K, BLOCKED, EVEN_K)
        if ACT >= 0:
            up_w = _weight_tile(up_w_ptrs, k0, cols, row_ok, K, EVEN_K)
            up_acc += _tile_sums(
                up_w, x_ptr, up_s_ptrs, k0, cols, groups, row_ok, K, BLOCK_N, GROUPS, SCALE_K, BLOCKED, EVEN_K
            )
    y = tl.sum(acc, axis=1)
    if not BLOCKED:
        y = y * tl.load(s_ptr + rows, mask=row_ok, other=0.0)
    if ACT >= 0:
        up = tl.sum(up_acc, axis=1)
        if not BLOCKED:
            up = up * tl.load(s_ptr + rows + N, mask=row_ok, other=0.0)
        y = _act(y, ACT) * up
    _store(y, b_ptr, y_ptr, rows, row_ok, HAS_BIAS)


@triton.jit
def _dot_tile(
    w_ptrs, x, s_ptrs, k0, cols, row_ok, K, acc, BLOCK_K: tl.constexpr, BLOCKED: tl.constexpr, EVEN_K: tl.constexpr
):
    """acc + x . W[rows, tile]^T, the weights widened to x's dtype for `tl.dot` (exact: every
    e4m3 value is a bf16 and an fp16 value); per block, the tile (one block wide) times its rows'
    scales."""
    if EVEN_K:
        w = tl.load(w_ptrs + k0, mask=row_ok[:, None], other=0.0, eviction_policy="evict_first")
    else:
        in_k = (k0 + cols) < K
        w = tl.load(w_ptrs + k0, mask=row_ok[:, None] & in_k[None, :], other=0.0, eviction_policy="evict_first")
    if BLOCKED:
        part = tl.dot(x, tl.trans(w.to(x.dtype)))
        acc += part * tl.load(s_ptrs + k0 // BLOCK_K, mask=row_ok, other=0.0)[None, :]
    else:
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
    return acc


@triton.jit
def _fp8_rows_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    s_stride,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # per block: the columns a block's scale covers
    SCALE_N: tl.constexpr,
    BLOCKED: tl.constexpr,
    EVEN_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """y[m, j] for every row m < M of x (padded to BLOCK_M) and the program's output features:
    each weight tile read once for all rows (with ACT, the gate's and the up projection's)."""
    pdl_start(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    ms = tl.arange(0, BLOCK_M)
    m_ok = ms < M
    cols = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + ms[:, None] * stride_xm + cols[None, :]
    w_ptrs = w_ptr + rows[:, None].to(tl.int64) * K + cols[None, :]
    s_ptrs = s_ptr + (rows // SCALE_N).to(tl.int64) * s_stride
    up_w_ptrs = w_ptrs + N.to(tl.int64) * K
    up_s_ptrs = s_ptr + ((rows + N) // SCALE_N).to(tl.int64) * s_stride
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs + k0, mask=m_ok[:, None], other=0.0)
        else:
            x = tl.load(x_ptrs + k0, mask=m_ok[:, None] & ((k0 + cols) < K)[None, :], other=0.0)
        acc = _dot_tile(w_ptrs, x, s_ptrs, k0, cols, row_ok, K, acc, BLOCK_K, BLOCKED, EVEN_K)
        if ACT >= 0:
            up_acc = _dot_tile(up_w_ptrs, x, up_s_ptrs, k0, cols, row_ok, K, up_acc, BLOCK_K, BLOCKED, EVEN_K)
    if not BLOCKED:
        acc = acc * tl.load(s_ptr + rows, mask=row_ok, other=0.0)[None, :]
    if ACT >= 0:
        if not BLOCKED:
            up_acc = up_acc * tl.load(s_ptr + rows + N, mask=row_ok, other=0.0)[None, :]
        acc = _act(acc, ACT) * up_acc
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + ms[:, None] * N + rows[None, :], acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & row_ok[None, :]
    )


def applies(x: torch.Tensor, weight: torch.Tensor, block: tuple[int, int] | None) -> bool:
    """One to MAX_ROWS rows of unit stride along K in half precision against a contiguous FP8
    weight, of a shape and layout the tables give a tile."""
    return (
        x.is_cuda
        and 0 < x.numel() <= MAX_ROWS * x.shape[-1]
        and x.shape[-1] == weight.shape[1]
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == FP8
        and weight.is_contiguous()
        and x.stride(-1) == 1
        and fp8_tile_for(weight.shape[0], weight.shape[1], x.numel() // x.shape[-1], block) is not None
    )


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] | None,
    bias: torch.Tensor | None,
    act: str | None,
    tile: Tile | None,
) -> torch.Tensor:
    k = weight.shape[1]
    n = weight.shape[0] // 2 if act else weight.shape[0]
    m = x.numel() // k
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    t = tile or fp8_tile_for(weight.shape[0], k, m, block)
    scale_n, scale_k = block or (1, min(t.cols, CHANNEL_SUM))  # per channel: pointer arithmetic and sums
    common = dict(
        HAS_BIAS=bias is not None,
        ACT=ACTIVATIONS[act] if act else -1,
        BLOCK_N=t.rows,
        BLOCK_K=t.cols,
        SCALE_N=scale_n,
        BLOCKED=block is not None,
        EVEN_K=k % t.cols == 0,
        num_warps=t.warps,
        num_stages=t.stages,
    )
    s_stride = scale.stride(0) if block else 0
    grid = (triton.cdiv(n, t.rows),)
    b = bias if bias is not None else scale
    if m > 1:
        x2 = x.reshape(m, k)
        _fp8_rows_kernel[grid](
            x2, weight, scale, b, y, m, n, k, x2.stride(0), s_stride, BLOCK_M=DOT_ROWS, **common, **pdl_options(grid[0])
        )
    else:
        groups = t.cols // scale_k
        _fp8_gemv_kernel[grid](
            x,
            weight,
            scale,
            b,
            y,
            n,
            k,
            s_stride,
            GROUPS=groups,
            SCALE_K=scale_k,
            **common,
            **pdl_options(grid[0]),
        )
    return y


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] | None,
    bias: torch.Tensor | None = None,
    tile: Tile | None = None,
) -> torch.Tensor:
    """`x @ W.T + bias` for one to MAX_ROWS rows (`applies`), W the FP8 weight times its scales,
    shaped like F.linear's; `tile` overrides the table's."""
    return _launch(x, weight, scale, block, bias, None, tile)


def gemv_act_and_mul(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] | None,
    act: str,
    tile: Tile | None = None,
) -> torch.Tensor:
    """`act(gate) * up` from a merged FP8 `[gate; up]` weight (`act` in ACTIVATIONS), as `gemv`."""
    return _launch(x, weight, scale, block, None, act, tile)
