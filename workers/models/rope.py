"""Rotary position embedding on CUDA: one Triton kernel for the queries and keys of a layer,
with the per-head RMSNorm of models that normalise q and k (Gemma 3, Qwen 3) folded in.

q and k arrive as strided views of the fused QKV projection's output. flashinfer's in-place
kernel needs contiguous rows (on strided views it rotated the wrong elements), so calling it
cost two copies a layer, three kernels in all; this kernel reads the views as they are and
writes contiguous rotated q and k in one launch (with the norms: one kernel where there were
three). The rotation and the K/V write are `attention/kernels/rotary.py`'s, which the split-KV
decode that rotates its own query shares (Neox style, float32 from the float32 cos/sin cache; a
normalised head rounded to the model's dtype before it rotates, as the separate norm's was).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention.kernels.launch import pdl_options, pdl_start
from attention.kernels.rotary import rotated_heads, write_new_kv
from attention.kv_pool import FP8_E4M3


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    q_out,
    k_out,
    pos_ptr,
    cache_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    q_heads,
    k_heads,
    q_norm_ptr,
    k_norm_ptr,
    eps,
    v_ptr,
    stride_vt,
    stride_vh,
    locs_ptr,
    page_size,
    stride_page,
    stride_kv,
    stride_head,
    k_inv_scale,
    v_inv_scale,
    v_eps,
    HEAD_DIM: tl.constexpr,
    ROTARY: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
    NORM: tl.constexpr,  # 0: none; 1: RMSNorm scaled by w (Qwen 3); 2: by 1 + w (Gemma 3)
    WRITE_KV: tl.constexpr,  # keys go to the paged cache at k_out (with v), not to a [T, Hk, D] tensor
    FP8: tl.constexpr,  # the cache is FP8: keys and values quantised with their scales (`fp8.py`)
    V_NORM: tl.constexpr,  # each value head RMS-normalised (no weight) before it is written (Gemma 4)
    PDL: tl.constexpr,
):
    """Program (t, h): head h of token t, a query head for h < q_heads, else a key head."""
    pdl_start(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    j = tl.arange(0, BLOCK_DIM)[None, :]
    pos = tl.load(pos_ptr + t).to(tl.int64)  # first: the cos/sin loads wait for it
    is_query = h < q_heads
    if is_query:
        src = q_ptr + t.to(tl.int64) * stride_qt + h * stride_qh
        norm_w = q_norm_ptr
    else:
        src = k_ptr + t.to(tl.int64) * stride_kt + (h - q_heads) * stride_kh
        norm_w = k_norm_ptr
    one = tl.full([1, 1], 1, tl.int1)
    dtype = q_out.dtype.element_ty  # the model's
    y = rotated_heads(
        src + tl.zeros([1, 1], tl.int32), one, pos, cache_ptr, norm_w, eps, HEAD_DIM, ROTARY, BLOCK_DIM, NORM, dtype
    )
    if is_query:
        tl.store(q_out + (t.to(tl.int64) * q_heads + h) * HEAD_DIM + j, y, mask=j < HEAD_DIM)
    elif WRITE_KV:
        loc = tl.load(locs_ptr + t).to(tl.int64)
        dst = k_out + (loc // page_size) * stride_page + (h - q_heads) * stride_head + (loc % page_size) * HEAD_DIM
        v_src = v_ptr + t.to(tl.int64) * stride_vt + (h - q_heads) * stride_vh
        value = tl.load(v_src + j, mask=j < HEAD_DIM, other=0.0)
        write_new_kv(dst, y, value, k_inv_scale, v_inv_scale, v_eps, stride_kv, HEAD_DIM, BLOCK_DIM, V_NORM, FP8)
    else:
        dst = k_out + (t.to(tl.int64) * k_heads + h - q_heads) * HEAD_DIM
        tl.store(dst + j, y, mask=j < HEAD_DIM)


def rope(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    norms: tuple[torch.Tensor, torch.Tensor | None, float, bool] | None = None,
    kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[float, float]] | None = None,
    v_norm_eps: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotated copies of q `[T, Hq, D]` and k `[T, Hk, D]` (or None), contiguous; each may be a
    view with any token and head strides and unit stride along D. `cos_sin_cache`: float32
    `[max_positions, rotary_dim]`, cos then sin. `norms`: (q weight, k weight, eps, gemma) of
    per-head RMSNorms applied first. `kv`: (paged cache `[pages, 2, Hk, page, D]`, slots, v,
    (K scale, V scale)): the rotated keys and v are written to the cache at the slots instead (k
    comes back None), cast to the cache's dtype, or quantised with the scales into an FP8 cache
    exactly as `attention.kv_pool.quantize` does; with `v_norm_eps` each value head is
    RMS-normalised (no weight) first."""
    if kv is not None and k is None:
        raise ValueError("rope: a KV destination needs the keys to write")
    tokens, q_heads, head_dim = q.shape
    k_heads = 0 if k is None else k.shape[1]
    q_out = torch.empty(tokens, q_heads, head_dim, dtype=q.dtype, device=q.device)
    k_out = None if k is None or kv else torch.empty(tokens, k_heads, head_dim, dtype=k.dtype, device=k.device)
    if tokens == 0:
        return q_out, k_out
    if q.stride(2) != 1 or (k is not None and k.stride(2) != 1):
        raise ValueError("rope: q and k need unit stride along the head dimension")
    rotary = cos_sin_cache.shape[-1]
    kk = q if k is None else k  # no key heads: never read
    q_w, k_w, eps, gemma = norms or (q, None, 0.0, False)  # no norms: weights never read
    no_cache = (q_out if k_out is None else k_out, positions, q, (1.0, 1.0))  # never written
    kv_cache, locs, v, scales = kv or no_cache
    if kv and (v.stride(-1) != 1 or kv_cache.stride(3) != head_dim or kv_cache.stride(4) != 1):
        raise ValueError("rope: v and the cache's heads need unit stride along the head dimension")
    v2 = v.view(tokens, k_heads, head_dim) if kv else v
    _rope_kernel[(tokens, q_heads + k_heads)](
        q,
        kk,
        q_out,
        kv_cache,
        positions,
        cos_sin_cache.float(),
        q.stride(0),
        q.stride(1),
        kk.stride(0),
        kk.stride(1),
        q_heads,
        k_heads,
        q_w,
        q_w if k_w is None else k_w,
        eps,
        v2,
        v2.stride(0),
        v2.stride(1),
        locs,
        kv_cache.shape[3] if kv else 1,
        kv_cache.stride(0),
        kv_cache.stride(1) if kv else 0,
        kv_cache.stride(2) if kv else 0,
        1.0 / scales[0],
        1.0 / scales[1],
        0.0 if v_norm_eps is None else v_norm_eps,
        HEAD_DIM=head_dim,
        ROTARY=rotary,
        BLOCK_DIM=triton.next_power_of_2(head_dim),
        NORM=0 if norms is None else 2 if gemma else 1,
        WRITE_KV=kv is not None,
        FP8=kv is not None and kv_cache.dtype == FP8_E4M3,
        V_NORM=kv is not None and v_norm_eps is not None,
        **pdl_options(tokens * (q_heads + k_heads)),
    )
    return q_out, k_out
