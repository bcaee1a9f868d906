"""Writing a forward's new K and V into a paged pool buffer, chosen once per device.

The buffer is flashinfer's stacked HND layout `[pages, 2, kv_heads, page_size, head_dim]`;
slot s is page s // page_size, offset s % page_size. On CUDA one Triton kernel writes K and V
of every (token, head) in a single launch (flashinfer's `append_paged_kv_cache` takes
per-request page lists, not per-token slots); elsewhere the torch reference indexes twice.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

KVWrite = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def write_kv_torch(buf: torch.Tensor, locs: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """The reference: `buf[page, 0, :, offset] = k`, `buf[page, 1, :, offset] = v`."""
    page_size = buf.shape[3]
    pages = torch.div(locs, page_size, rounding_mode="floor")
    offs = locs % page_size
    buf[pages, 0, :, offs, :] = k.to(buf.dtype)
    buf[pages, 1, :, offs, :] = v.to(buf.dtype)


@functools.cache
def _triton_kernel():
    import triton
    import triton.language as tl

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
        head_dim: tl.constexpr,
        block_d: tl.constexpr,
    ):
        t = tl.program_id(0)
        h = tl.program_id(1)
        loc = tl.load(locs + t).to(tl.int64)
        page, offset = loc // page_size, loc % page_size
        d = tl.arange(0, block_d)
        mask = d < head_dim
        head_block = page_size * head_dim
        dst = page * (2 * num_heads * head_block) + h * head_block + offset * head_dim + d
        tl.store(buf + dst, tl.load(k + t * stride_kt + h * stride_kh + d, mask=mask), mask=mask)
        tl.store(
            buf + dst + num_heads * head_block, tl.load(v + t * stride_vt + h * stride_vh + d, mask=mask), mask=mask
        )

    return write_kv, triton.next_power_of_2


def write_kv_cuda(buf: torch.Tensor, locs: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    tokens, num_heads, head_dim = k.shape
    if tokens == 0:
        return
    if k.dtype != buf.dtype or v.dtype != buf.dtype or k.stride(2) != 1 or v.stride(2) != 1:
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
        head_dim,
        next_pow2(head_dim),
    )


KV_WRITERS: dict[str, KVWrite] = {"cpu": write_kv_torch, "cuda": write_kv_cuda}


def kv_writer(device: torch.device | str) -> KVWrite:
    return KV_WRITERS.get(torch.device(device).type, write_kv_torch)
