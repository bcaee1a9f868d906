"""Gemma's sandwich norms on CUDA: the norm after a sub-layer, the residual add and the norm
before the next sub-layer, in one Triton kernel.

A Gemma layer normalises each sub-layer's output before adding it to the residual stream, and
the stream again before the next sub-layer: `norm_b(residual + norm_a(x))`. As flashinfer's
kernels that is an RMSNorm and a fused add + RMSNorm, two launches and a round trip of
`norm_a(x)` through memory, twice a layer (after attention; after the MLP into the next
layer's input norm). One program a token row: float32 statistics, `norm_a(x)` rounded to the
model's dtype and added to the residual in that dtype, as Hugging Face's modules compute it.
Gemma 4 scales the stream after each layer by a learned scalar (read from the device, rounded
as a multiply in the dtype rounds) before the next layer's norm; where no norm follows (the
stream a projection reads whole: Gemma 4's per-layer input gate) `norm_add` stops at the stream;
it may norm its residual operand first, adding two normed rows (Gemma 4's MoE-block branches).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention.kernels.launch import pdl_options, pdl_start
from attention.kernels.rotary import scaled


@triton.jit
def normed(x, w, mask, eps, size, GEMMA: tl.constexpr, dtype: tl.constexpr):
    """RMSNorm of a float32 row, rounded to `dtype` the way the model's norm rounds."""
    rstd = tl.rsqrt(tl.sum(tl.where(mask, x * x, 0.0)) / size + eps)
    return scaled(x * rstd, w, GEMMA, dtype)


@triton.jit
def _norm_add_norm_kernel(
    x_ptr,
    res_ptr,
    w_before_ptr,
    w_ptr,
    w_res_ptr,
    scale_ptr,
    out_ptr,
    size,
    eps,
    stride_x,
    stride_res,
    GEMMA: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    AFTER: tl.constexpr,  # the norm after the add (else the stream alone)
    RES_NORM: tl.constexpr,  # the residual operand normed first (Gemma 4's two MoE-block branches)
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < size
    dtype = res_ptr.dtype.element_ty
    # every load first: the statistics wait for one round trip to memory, not three
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    w_before = tl.load(w_before_ptr + cols, mask=mask, other=0.0)
    res = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
    if AFTER:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    if RES_NORM:
        res = normed(res.to(tl.float32), tl.load(w_res_ptr + cols, mask=mask, other=0.0), mask, eps, size, GEMMA, dtype)
    res += normed(x, w_before, mask, eps, size, GEMMA, dtype)
    if HAS_SCALE:
        res = (res.to(tl.float32) * tl.load(scale_ptr).to(dtype).to(tl.float32)).to(dtype)
    tl.store(res_ptr + row * stride_res + cols, res, mask=mask)
    if AFTER:
        tl.store(out_ptr + row * size + cols, normed(res.to(tl.float32), w, mask, eps, size, GEMMA, dtype), mask=mask)


def norm_add_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    before: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    gemma: bool,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(s, weight), s) over the last dimension, s = (residual + rms_norm(x, before)) *
    scale (no scale: 1); the residual is updated in place and returned."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return out, _launch(x, residual, before, weight, eps, gemma, scale, out)


def norm_add(
    x: torch.Tensor,
    residual: torch.Tensor,
    before: torch.Tensor,
    eps: float,
    gemma: bool,
    scale: torch.Tensor | None,
    residual_norm: torch.Tensor | None = None,
) -> torch.Tensor:
    """`(r + rms_norm(x, before)) * scale` (no scale: 1) over the last dimension, r the residual
    or, with `residual_norm`, rms_norm(residual, residual_norm); into the residual, which is
    returned."""
    return _launch(x, residual, before, None, eps, gemma, scale, None, residual_norm)


def _launch(x, residual, before, weight, eps, gemma, scale, out, residual_norm=None) -> torch.Tensor:
    size = x.shape[-1]
    x2, res2 = x.reshape(-1, size), residual.view(-1, size)
    if x2.stride(-1) != 1 or res2.stride(-1) != 1:
        raise ValueError(
            f"sandwich norm: rows need unit stride along the last dimension, got x strides {tuple(x.stride())}, "
            f"residual strides {tuple(residual.stride())}"
        )
    if x2.shape[0]:
        block = triton.next_power_of_2(size)
        _norm_add_norm_kernel[(x2.shape[0],)](
            x2,
            res2,
            before,
            weight if weight is not None else before,
            residual_norm if residual_norm is not None else before,
            scale if scale is not None else before,
            out if out is not None else res2,
            size,
            eps,
            x2.stride(0),
            res2.stride(0),
            GEMMA=gemma,
            HAS_SCALE=scale is not None,
            AFTER=weight is not None,
            RES_NORM=residual_norm is not None,
            BLOCK=block,
            num_warps=min(16, max(1, block // 256)),
            **pdl_options(x2.shape[0]),
        )
    return residual
