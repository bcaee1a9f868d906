"""Matrix products of FP8 weights on CUDA (prefill, batches past the GEMV's rows): W8A8 through
`torch._scaled_mm` (docs/design.md §4.9).

Activations are quantised as they come, one Triton kernel a product: a scale per token (its
largest magnitude / 448) against weights with a scale per output channel (cuBLAS's row-wise
scaled GEMM), or a scale per token and 128 columns against 128 x 128 weight blocks (its 1x128 /
128x128 block-scaled GEMM, as DeepSeek's recipe; Hopper with CUDA 12.9 or later). Both accumulate
in float32 and write the activations' dtype. Where neither applies (fp16 activations, shapes off
the GEMMs' multiples of 16 or 128, other blocks, other GPUs) the weights are dequantised to the
activations' dtype and multiplied there: exact weights, no activation rounding, more bytes.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from attention.kernels.launch import pdl_options, pdl_start
from attention.kv_pool import FP8_E4M3_MAX
from workers.models.fp8 import FP8, TINY, dequantize

GROUP = 128  # columns an activation scale covers against block-scaled weights
BLOCKWISE = (GROUP, GROUP)  # the weight blocks cuBLAS's block-scaled GEMM takes
ROW_MULTIPLE = 16  # rows cuBLAS's block-scaled GEMM takes (509 fails heuristics; 64 runs): padded with zeros
QUANT_WIDTH = 1024  # columns a per-token program reads at a time


@triton.jit
def _quantize_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    K,
    stride_xm,
    stride_sm,
    stride_sg,
    GROUP: tl.constexpr,  # 0: one scale for the row; else the columns a scale covers
    BLOCK: tl.constexpr,  # columns read at a time (GROUP when grouped)
    FP8_MAX: tl.constexpr,
    TINY: tl.constexpr,
    PDL: tl.constexpr,
):
    """Row m of x as e4m3: x / scale saturated and rounded to nearest, scale = the row's (or
    the group's) largest magnitude / FP8_MAX, at least TINY / FP8_MAX."""
    pdl_start(PDL)
    m = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x_row = x_ptr + m * stride_xm
    q_row = q_ptr + m * K
    if GROUP == 0:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            x = tl.load(x_row + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, axis=0), TINY) / FP8_MAX
        tl.store(s_ptr + m * stride_sm, scale)
        for k0 in range(0, K, BLOCK):
            x = tl.load(x_row + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
            q = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
            tl.store(q_row + k0 + cols, q.to(q_ptr.dtype.element_ty), mask=k0 + cols < K)
    else:
        for k0 in range(0, K, GROUP):
            x = tl.load(x_row + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
            scale = tl.maximum(tl.max(tl.abs(x), axis=0), TINY) / FP8_MAX
            tl.store(s_ptr + m * stride_sm + (k0 // GROUP) * stride_sg, scale)
            q = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
            tl.store(q_row + k0 + cols, q.to(q_ptr.dtype.element_ty), mask=k0 + cols < K)


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 `[M, K]`, float32 scales) of the rows of `x` `[M, K]` (unit stride along K): group 0
    gives `[M, 1]` (a scale per token), else `[M, K / group]` laid out column-major, as the
    block-scaled GEMM reads them."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=FP8, device=x.device)
    if group:
        scale = torch.empty(triton.cdiv(k, group), m, dtype=torch.float32, device=x.device).t()
    else:
        scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    block = group or min(QUANT_WIDTH, triton.next_power_of_2(k))
    _quantize_kernel[(m,)](
        x,
        q,
        scale,
        k,
        x.stride(0),
        scale.stride(0),
        scale.stride(1),
        GROUP=group,
        BLOCK=block,
        FP8_MAX=FP8_E4M3_MAX,
        TINY=TINY,
        num_warps=4,
        **pdl_options(m),
    )
    return q, scale


@functools.cache
def blockwise_gemm() -> bool:
    """Whether cuBLAS's 1x128 / 128x128 block-scaled FP8 GEMM runs here: Hopper (SM90), CUDA 12.9
    or later (torch refuses it elsewhere)."""
    cuda = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
    return torch.cuda.get_device_capability() == (9, 0) and cuda >= (12, 9)


def w8a8_applies(x: torch.Tensor, weight: torch.Tensor, block: tuple[int, int] | None) -> bool:
    """Whether `linear` quantises x and runs a scaled GEMM: bf16 activations (at least a row), K
    and N multiples of 16 (per channel) or whole 128 x 128 blocks with cuBLAS's block-scaled GEMM
    at hand."""
    n, k = weight.shape
    if x.dtype != torch.bfloat16 or k % 16 or n % 16 or x.numel() == 0:
        return False
    return block is None or (block == BLOCKWISE and k % GROUP == 0 and n % GROUP == 0 and blockwise_gemm())


def linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, bias: torch.Tensor | None
) -> torch.Tensor:
    """`x @ W.T + bias`, W the FP8 weight `[N, K]` times its scales, shaped like F.linear's."""
    n, k = weight.shape
    if not w8a8_applies(x, weight, block):
        return F.linear(x, dequantize(weight, scale, block, x.dtype), bias)
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if block is not None and m % ROW_MULTIPLE:  # the block-scaled GEMM refuses other row counts
        x2 = F.pad(x2, (0, 0, 0, ROW_MULTIPLE - m % ROW_MULTIPLE))
    elif x2.stride(-1) != 1:
        x2 = x2.contiguous()
    q, x_scale = quantize_activations(x2, GROUP if block else 0)
    w_scale = scale.view(1, n) if block is None else scale.t()  # blocks: [K / 128, N / 128], column-major
    out = torch._scaled_mm(q, weight.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=x.dtype)[:m]
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], n)
