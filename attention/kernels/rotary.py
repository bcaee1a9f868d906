"""RoPE of attention heads inside Triton kernels, and the write of a token's new K and V: the
math the RoPE kernel (`workers/models/rope.py`) and the split-KV decode that rotates its own
query (`split_decode.py`) share, so both round every value the same way.

Neox style: feature j < R/2 rotates with j + R/2 (R the rotary width), features past R pass
through; the per-head RMSNorm of qk-norm models (Qwen 3: times w; Gemma: times 1 + w) comes
first, its output rounded to the model's dtype as the separate norm's was; float32 arithmetic
from the float32 cos/sin cache, the rotated head rounded to the model's dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl

from attention.kernels.fp8 import fp8_saturate


@triton.jit
def scaled(h, w, GEMMA: tl.constexpr, dtype: tl.constexpr):
    """A normalised float32 row times its norm weight, rounded to the model's dtype as Hugging
    Face's norms round: Gemma scales in float32 by 1 + w, then casts; Llama-style norms cast,
    then scale by w."""
    if GEMMA:
        return (h * (1.0 + w.to(tl.float32))).to(dtype)
    return h.to(dtype) * w.to(dtype)


@triton.jit
def rotated_heads(
    base,
    rows_ok,
    pos,
    cos_sin_ptr,
    norm_ptr,
    eps,
    HEAD_DIM: tl.constexpr,
    ROTARY: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
    NORM: tl.constexpr,  # 0: none; 1: RMSNorm times w; 2: times 1 + w
    dtype: tl.constexpr,
):
    """`[R, BLOCK_DIM]` heads in `dtype` (zeros past HEAD_DIM and in rows not `rows_ok`):
    `base` holds R heads' first features (`[R, 1]` pointers, unit stride along a head), `pos`
    their position. Each feature's rotation partner is read as a second load (both hit the same
    lines), so the result is one tensor of whole heads."""
    half: tl.constexpr = ROTARY // 2
    j = tl.arange(0, BLOCK_DIM)[None, :]
    in_head = j < HEAD_DIM
    rotates = j < ROTARY
    first = j < half
    partner = tl.where(first, j + half, tl.where(rotates, j - half, j))
    x = tl.load(base + j, mask=rows_ok & in_head, other=0.0).to(tl.float32)
    xq = tl.load(base + partner, mask=rows_ok & rotates, other=0.0).to(tl.float32)
    row = cos_sin_ptr + pos * ROTARY
    freq = tl.where(first, j, j - half)
    cos = tl.load(row + freq, mask=rotates, other=1.0)
    sin = tl.load(row + half + freq, mask=rotates, other=0.0)
    if NORM:
        w = tl.load(norm_ptr + j, mask=in_head, other=0.0)
        wq = tl.load(norm_ptr + partner, mask=rotates, other=0.0)
        rstd = tl.rsqrt(tl.sum(x * x, 1) / HEAD_DIM + eps)[:, None]
        x = scaled(x * rstd, w, NORM == 2, dtype).to(tl.float32)
        xq = scaled(xq * rstd, wq, NORM == 2, dtype).to(tl.float32)
    return (x * cos + tl.where(first, -xq, xq) * sin).to(dtype)


@triton.jit
def write_new_kv(
    dst,
    key,
    value_base,
    k_inv_scale,
    v_inv_scale,
    v_eps,
    stride_kv,
    HEAD_DIM: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
    V_NORM: tl.constexpr,  # the value head RMS-normalised (no weight) first (Gemma 4)
    FP8: tl.constexpr,  # the cache is FP8: both quantised with their scales (`fp8.py`)
):
    """Store a token's rotated key (`[1, BLOCK_DIM]`, the model's dtype) at `dst` (its slot's K
    head; V at dst + stride_kv) and its value head read from `value_base` (`[1, 1]`); returns
    (key, value) as the cache now holds them, widened back to the model's dtype (exact)."""
    dtype = key.dtype
    j = tl.arange(0, BLOCK_DIM)[None, :]
    in_head = j < HEAD_DIM
    value = tl.load(value_base + j, mask=in_head, other=0.0)
    if V_NORM:  # rounded to the model's dtype as the separate norm's output was
        vf = value.to(tl.float32)
        value = (vf * tl.rsqrt(tl.sum(vf * vf) / HEAD_DIM + v_eps)).to(dtype)
    if FP8:  # new names: a branch may not change a variable's type
        k_stored = fp8_saturate(key, k_inv_scale).to(dst.dtype.element_ty)
        v_stored = fp8_saturate(value, v_inv_scale).to(dst.dtype.element_ty)
    else:
        k_stored, v_stored = key.to(dst.dtype.element_ty), value.to(dst.dtype.element_ty)
    tl.store(dst + j, k_stored, mask=in_head)
    tl.store(dst + stride_kv + j, v_stored, mask=in_head)
    return k_stored.to(dtype), v_stored.to(dtype)
