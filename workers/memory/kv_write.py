"""Writing a forward's new K and V into a paged pool buffer, chosen once per device.

The buffer is flashinfer's stacked HND layout `[pages, 2, kv_heads, page_size, head_dim]`;
slot s is page s // page_size, offset s % page_size. On CUDA one Triton kernel writes K and V
of every (token, head) in a single launch (flashinfer's `append_paged_kv_cache` takes
per-request page lists, not per-token slots); elsewhere the torch reference indexes twice.

An FP8 buffer (`kv_cache_dtype: fp8_e4m3`) stores `quantize(value, scale)`: value / scale,
saturated to +-448, rounded to nearest. Every writer does exactly that (the torch reference
here, this module's Triton kernel, the fused RoPE + KV-write kernel in `workers/models/rope.py`),
so the cache holds one number format whoever wrote it (docs/design.md §4.7).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from attention.kv_pool import FP8_E4M3, quantize

# (buffer, slots, k, v, k scale, v scale)
KVWrite = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, float], None]

KV_CACHE_DTYPES = {"fp8_e4m3": FP8_E4M3}  # beside "auto": the model's dtype


def resolve_kv_cache_dtype(setting: str, model_dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The KV buffers' dtype for the `kv_cache_dtype` setting: "auto" is the model's dtype;
    checked before any weight is loaded (the attention backend checks its kernels take it)."""
    if setting == "auto":
        return model_dtype
    if setting not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: unknown {setting!r}; choose from {['auto', *KV_CACHE_DTYPES]}")
    return KV_CACHE_DTYPES[setting]


def write_kv_torch(
    buf: torch.Tensor, locs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0
) -> None:
    """The reference: `buf[page, 0, :, offset] = k`, `buf[page, 1, :, offset] = v`, quantised
    with the layer's scales when `buf` is FP8."""
    page_size = buf.shape[3]
    pages = torch.div(locs, page_size, rounding_mode="floor")
    offs = locs % page_size
    buf[pages, 0, :, offs, :] = quantize(k, k_scale, buf.dtype)
    buf[pages, 1, :, offs, :] = quantize(v, v_scale, buf.dtype)


@functools.cache
def _triton_kernel():
    import triton
    import triton.language as tl

    from attention.kernels.fp8 import fp8_saturate

    @triton.jit
    def write_kv(
        buf,
        locs,
        k,
        v,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        page_size,
        num_heads,
        k_inv_scale,
        v_inv_scale,
        head_dim: tl.constexpr,
        block_d: tl.constexpr,
        FP8: tl.constexpr,
    ):
        t = tl.program_id(0)
        h = tl.program_id(1)
        loc = tl.load(locs + t).to(tl.int64)
        page, offset = loc // page_size, loc % page_size
        d = tl.arange(0, block_d)
        mask = d < head_dim
        head_block = page_size * head_dim
        dst = page * (2 * num_heads * head_block) + h * head_block + offset * head_dim + d
        kk = tl.load(k + t * stride_kt + h * stride_kh + d, mask=mask)
        vv = tl.load(v + t * stride_vt + h * stride_vh + d, mask=mask)
        if FP8:
            kk = fp8_saturate(kk, k_inv_scale)
            vv = fp8_saturate(vv, v_inv_scale)
        tl.store(buf + dst, kk.to(buf.dtype.element_ty), mask=mask)
        tl.store(buf + dst + num_heads * head_block, vv.to(buf.dtype.element_ty), mask=mask)

    return write_kv, triton.next_power_of_2


def write_kv_cuda(
    buf: torch.Tensor, locs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0
) -> None:
    tokens, num_heads, head_dim = k.shape
    if tokens == 0:
        return
    fp8 = buf.dtype == FP8_E4M3
    if fp8:  # quantised in the kernel from the model's dtype
        k, v = k.contiguous() if k.stride(2) != 1 else k, v.contiguous() if v.stride(2) != 1 else v
    elif k.dtype != buf.dtype or v.dtype != buf.dtype or k.stride(2) != 1 or v.stride(2) != 1:
        k, v = k.to(buf.dtype).contiguous(), v.to(buf.dtype).contiguous()
    kernel, next_pow2 = _triton_kernel()
    kernel[(tokens, num_heads)](
        buf,
        locs,
        k,
        v,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        buf.shape[3],
        num_heads,
        1.0 / k_scale,
        1.0 / v_scale,
        head_dim,
        next_pow2(head_dim),
        fp8,
    )


KV_WRITERS: dict[str, KVWrite] = {"cpu": write_kv_torch, "cuda": write_kv_cuda}


def kv_writer(device: torch.device | str) -> KVWrite:
    """The writer of KV buffers on `device` (any dtype the pools hold)."""
    return KV_WRITERS.get(torch.device(device).type, write_kv_torch)
