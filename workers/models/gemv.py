"""One-row projections on CUDA: a Triton GEMV, and one fused with the gated activation.

A batch-1 decode step is a stream of weight reads. cuBLAS's kernels for a single row read the
weights of an 8B model's QKV and O projections at 60-77% of the device's copy rate and add
split-K reduce kernels; this kernel reads them 10-29% faster (`ops/bench/gemv_bandwidth.py`
measures both on the model shapes), and the fused variant writes `act(gate) * up` straight from the
merged gate/up weight, so the MLP's activation kernel and its round trip through memory go.
Each program owns `rows` output features and walks K in `cols`-wide tiles, accumulating in
float32. Only one row (`x` of shape `[1, K]`) takes this path; wider inputs are matrix
multiplications and stay on cuBLAS.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl


@dataclasses.dataclass(frozen=True)
class Tile:
    rows: int  # output features a program computes
    cols: int  # K elements it reads a row per iteration
    warps: int
    stages: int


# First match on (out_features >= rows_at_least, in_features >= cols_at_least), tuned on an H200
# with ops/bench/gemv_bandwidth.py over Llama-3-8B and Gemma-3-1B projections.
TILES: tuple[tuple[int, int, Tile], ...] = (
    (8192, 0, Tile(16, 256, 4, 4)),  # wide: gate/up, LM heads
    (0, 6144, Tile(4, 512, 8, 2)),  # long rows: down projections
    (6144, 0, Tile(8, 512, 4, 4)),  # fused QKV
    (0, 0, Tile(4, 512, 4, 4)),  # square: O projections
)

ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}  # the fused kernel's `ACT` codes


def tile_for(out_features: int, in_features: int) -> Tile:
    return next(t for n, k, t in TILES if out_features >= n and in_features >= k)


@triton.jit
def _tile(w_ptrs, x_ptr, k0, cols, row_ok, K, EVEN_K: tl.constexpr):
    """One K tile: the weight rows' products with x, float32 (masked past N and K)."""
    if EVEN_K:
        w = tl.load(w_ptrs + k0, mask=row_ok[:, None], other=0.0, eviction_policy="evict_first")
        x = tl.load(x_ptr + k0 + cols)
    else:
        in_k = (k0 + cols) < K
        w = tl.load(w_ptrs + k0, mask=row_ok[:, None] & in_k[None, :], other=0.0, eviction_policy="evict_first")
        x = tl.load(x_ptr + k0 + cols, mask=in_k, other=0.0)
    return w.to(tl.float32) * x.to(tl.float32)[None, :]


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    N,
    K,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    cols = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows[:, None].to(tl.int64) * K + cols[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        acc += _tile(w_ptrs, x_ptr, k0, cols, row_ok, K, EVEN_K)
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _gemv_act_mul_kernel(
    x_ptr, w_ptr, y_ptr, N, K, ACT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr
):
    """y[j] = act(W[j] . x) * (W[N + j] . x): gate rows first, up rows after them; both tiles
    are read in the same iteration, so a program keeps two streams of loads in flight."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    cols = tl.arange(0, BLOCK_K)
    gate_ptrs = w_ptr + rows[:, None].to(tl.int64) * K + cols[None, :]
    up_ptrs = gate_ptrs + N.to(tl.int64) * K
    gate_acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    up_acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        gate_acc += _tile(gate_ptrs, x_ptr, k0, cols, row_ok, K, EVEN_K)
        up_acc += _tile(up_ptrs, x_ptr, k0, cols, row_ok, K, EVEN_K)
    gate, up = tl.sum(gate_acc, axis=1), tl.sum(up_acc, axis=1)
    if ACT == 0:  # SiLU
        act = gate * tl.sigmoid(gate)
    else:  # GELU, tanh approximation: tanh(u) = 2 sigmoid(2u) - 1
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = gate * tl.sigmoid(2.0 * inner)
    tl.store(y_ptr + rows, (act * up).to(y_ptr.dtype.element_ty), mask=row_ok)


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """One row against a contiguous half-precision weight of the same dtype."""
    return (
        x.is_cuda
        and x.numel() == x.shape[-1]
        and x.shape[-1] == weight.shape[1]
        and x.dtype == weight.dtype
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.is_contiguous()
        and x.stride(-1) == 1
    )


def gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, tile: Tile | None = None
) -> torch.Tensor:
    """`x @ weight.T + bias` for one row (`applies(x, weight)`), shaped like F.linear's; `tile`
    overrides the table's (the benchmark's sweep)."""
    n, k = weight.shape
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    t = tile or tile_for(n, k)
    _gemv_kernel[(triton.cdiv(n, t.rows),)](
        x,
        weight,
        bias if bias is not None else weight,
        y,
        n,
        k,
        HAS_BIAS=bias is not None,
        BLOCK_N=t.rows,
        BLOCK_K=t.cols,
        EVEN_K=k % t.cols == 0,
        num_warps=t.warps,
        num_stages=t.stages,
    )
    return y


def gemv_act_and_mul(x: torch.Tensor, weight: torch.Tensor, act: str) -> torch.Tensor:
    """`act(gate) * up` of one row, from a merged `[gate; up]` weight (`act` in ACTIVATIONS)."""
    n, k = weight.shape[0] // 2, weight.shape[1]
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    t = tile_for(2 * n, k)
    rows = max(1, t.rows // 2)  # a program reads t.rows weight rows: half gate rows, half up rows
    _gemv_act_mul_kernel[(triton.cdiv(n, rows),)](
        x,
        weight,
        y,
        n,
        k,
        ACT=ACTIVATIONS[act],
        BLOCK_N=rows,
        BLOCK_K=t.cols,
        EVEN_K=k % t.cols == 0,
        num_warps=t.warps,
        num_stages=t.stages,
    )
    return y
