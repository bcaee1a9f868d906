"""Random paged KV caches for kernel tests: dense K/V per request scattered over shuffled pages."""

from __future__ import annotations

import torch

from attention.kernels.calls import cdiv


def random_paged_kv(
    kv_lens: list[int],
    page: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
):
    """(kv_cache `[pages+1, 2, Hkv, page, D]`, int32 block tables, [(k, v) dense per request])."""
    g = torch.Generator().manual_seed(seed)
    n_pages = sum(cdiv(n, page) for n in kv_lens)
    order = (torch.randperm(n_pages, generator=g) + 1).tolist()
    cache = torch.zeros(n_pages + 1, 2, kv_heads, page, head_dim)
    tables = torch.zeros(len(kv_lens), max(cdiv(n, page) for n in kv_lens), dtype=torch.int32)
    dense = []
    for b, n in enumerate(kv_lens):
        k, v = torch.randn(n, kv_heads, head_dim, generator=g), torch.randn(n, kv_heads, head_dim, generator=g)
        for j in range(cdiv(n, page)):
            pg = order.pop()
            tables[b, j] = pg
            lo, hi = j * page, min(n, (j + 1) * page)
            cache[pg, 0, :, : hi - lo] = k[lo:hi].transpose(0, 1)
            cache[pg, 1, :, : hi - lo] = v[lo:hi].transpose(0, 1)
        dense.append((k.to(device), v.to(device)))
    return cache.to(device=device, dtype=dtype), tables.to(device), dense
