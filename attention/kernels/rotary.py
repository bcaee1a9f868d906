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
def rotation(pos, cos_sin_ptr, ROTARY: tl.constexpr, BLOCK_DIM: tl.constexpr):
    """(cos, signed sin) `[1, BLOCK_DIM]` of position `pos` per feature (1 and 0 past the rotary
    width): what a rotation reads besides the head, so a kernel may load it before its PDL wait."""
    half: tl.constexpr = ROTARY // 2
    j = tl.arange(0, BLOCK_DIM)[None, :]
    rotates = j < ROTARY
    first = j < half
    row = cos_sin_ptr + pos * ROTARY
    freq = tl.where(first, j, j - half)
    cos = tl.load(row + freq, mask=rotates, other=1.0)
    sin = tl.load(row + half + freq, mask=rotates, other=0.0)
    return cos, tl.where(first, -sin, sin)


@triton.jit
def norm_weights(norm_ptr, HEAD_DIM: tl.constexpr, ROTARY: tl.constexpr, BLOCK_DIM: tl.constexpr, NORM: tl.constexpr):
    """The per-head norm's weights at each feature and at its rotation partner, float32
    `[1, BLOCK_DIM]` (zeros without a norm)."""
    j = tl.arange(0, BLOCK_DIM)[None, :]
    if NORM:
        w = tl.load(norm_ptr + j, mask=j < HEAD_DIM, other=0.0).to(tl.float32)
        wq = tl.load(norm_ptr + _partner(j, ROTARY), mask=j < ROTARY, other=0.0).to(tl.float32)
    else:
        w = tl.zeros([1, BLOCK_DIM], tl.float32)
        wq = w
    return w, wq


@triton.jit
def head_pairs(base, rows_ok, HEAD_DIM: tl.constexpr, ROTARY: tl.constexpr, BLOCK_DIM: tl.constexpr):
    """`[R, BLOCK_DIM]` heads at `base` (`[R, 1]` pointers to their first features, unit stride
    along a head) and each feature's rotation partner, float32 (zeros past HEAD_DIM and in rows
    not `rows_ok`); both loads hit the same lines."""
    j = tl.arange(0, BLOCK_DIM)[None, :]
    x = tl.load(base + j, mask=rows_ok & (j < HEAD_DIM), other=0.0).to(tl.float32)
    xq = tl.load(base + _partner(j, ROTARY), mask=rows_ok & (j < ROTARY), other=0.0).to(tl.float32)
    return x, xq


@triton.jit
def rotate(x, xq, cos, sin, w, wq, eps, HEAD_DIM: tl.constexpr, NORM: tl.constexpr, dtype: tl.constexpr):
    """Heads (`head_pairs`) normed with `norm_weights` (NORM 1: times w; 2: times 1 + w) and
    rotated by `rotation`, in `dtype`."""
    if NORM:
        rstd = tl.rsqrt(tl.sum(x * x, 1) / HEAD_DIM + eps)[:, None]
        x = scaled(x * rstd, w, NORM == 2, dtype).to(tl.float32)
        xq = scaled(xq * rstd, wq, NORM == 2, dtype).to(tl.float32)
    return (x * cos + xq * sin).to(dtype)


@triton.jit
def _partner(j, ROTARY: tl.constexpr):
    """The feature each feature rotates with (itself past the rotary width)."""
    half: tl.constexpr = ROTARY // 2
    return tl.where(j < half, j + half, tl.where(j < ROTARY, j - half, j))


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
    """`[R, BLOCK_DIM]` heads at `base` (`head_pairs`) at position `pos`, normed and rotated."""
    x, xq = head_pairs(base, rows_ok, HEAD_DIM, ROTARY, BLOCK_DIM)
    cos, sin = rotation(pos, cos_sin_ptr, ROTARY, BLOCK_DIM)
    w, wq = norm_weights(norm_ptr, HEAD_DIM, ROTARY, BLOCK_DIM, NORM)
    return rotate(x, xq, cos, sin, w, wq, eps, HEAD_DIM, NORM, dtype)


@triton.jit
def write_new_kv(
    dst,
    key,
    value,
    k_inv_scale,
    v_inv_scale,
    v_eps,
    stride_kv,
    HEAD_DIM: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
    V_NORM: tl.constexpr,  # the value head RMS-normalised (no weight) first (Gemma 4)
    FP8: tl.constexpr,  # the cache is FP8: both quantised with their scales (`fp8.py`)
):
    """Store a token's rotated key and its value head (`[1, BLOCK_DIM]`, the model's dtype) at
    `dst` (its slot's K head; V at dst + stride_kv); returns (key, value) as the cache now holds
    them, widened back to the model's dtype (exact)."""
    dtype = key.dtype
    j = tl.arange(0, BLOCK_DIM)[None, :]
    in_head = j < HEAD_DIM
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
