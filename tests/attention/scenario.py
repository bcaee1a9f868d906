"""A hand-built hybrid-SWA KV state shared by a target (hybrid pool) and a draft-like model
(full-only pool) on one allocator, for driving attention backends forward by forward; its KV in
float32 or FP8 (each layer with its own K and V scales)."""

from __future__ import annotations

import torch

from attention import AttentionLayer, ForwardMode, create_backend
from workers.forward_batch import ForwardBatch
from workers.memory import HybridSWAAllocator, ReqToTokenPool, build_pool, kv_layouts

H, HKV, D = 4, 2, 8
KV_DTYPES = {"auto": torch.float32, "fp8_e4m3": torch.float8_e4m3fn}
FP8_SCALES = {0: (0.5, 0.25), 1: (2.0, 1.0), 2: (0.125, 4.0)}  # (K, V) scale of each layer, in an FP8 cache


class Scenario:
    def __init__(
        self,
        page_size: int = 4,
        window: int = 6,
        full_pages: int = 96,
        swa_pages: int = 16,
        seed: int = 0,
        kv_cache_dtype: str = "auto",
    ):
        self.page_size, self.window = page_size, window
        self.gen = torch.Generator().manual_seed(seed)
        self.r2t = ReqToTokenPool(32, 512, "cpu")
        self.alloc = HybridSWAAllocator(self.r2t, full_pages, swa_pages, page_size, window)
        windows = {0: window, 1: None, 2: window}
        fp8 = kv_cache_dtype == "fp8_e4m3"
        scales = {i: FP8_SCALES[i] if fp8 else (1.0, 1.0) for i in windows}
        self.layers = [
            AttentionLayer(i, H, HKV, D, scaling=D**-0.5, sliding_window=w, k_scale=scales[i][0], v_scale=scales[i][1])
            for i, w in windows.items()
        ]
        layouts = kv_layouts(self.layers)
        dtype = KV_DTYPES[kv_cache_dtype]
        self.hybrid_pool = build_pool(layouts, self.alloc, dtype, "cpu")
        self.full_pool = build_pool(layouts, self.alloc, dtype, "cpu", use_swa_pool=False)

    def push_full_ids_up(self, pages: int) -> None:
        """A long request holding the lowest full pages (and a window of SWA pages), so later
        full slot ids are larger than the SWA pool."""
        row = self.r2t.alloc()
        for _ in range(pages):
            self.alloc.extend(row, self.page_size)
            self.alloc.release_window(row, self.alloc.allocated_len(row))

    def add_request(self, length: int) -> int:
        """A request whose first `length` tokens have random KV in both pools."""
        row = self.r2t.alloc()
        for start in range(0, length, self.page_size):  # page by page, like a chunked prefill
            n = min(self.page_size, length - start)
            locs = self.alloc.extend(row, n)
            for layer in self.layers:
                k = torch.randn(n, HKV, D, generator=self.gen)
                v = torch.randn(n, HKV, D, generator=self.gen)
                self.full_pool.set_kv(layer.layer_id, locs, k, v)
                swa = self.hybrid_pool.is_swa_layer(layer.layer_id)
                self.hybrid_pool.set_kv(
                    layer.layer_id, self.hybrid_pool.translate_full_to_swa(locs) if swa else locs, k, v
                )
            self.alloc.release_window(row, start + n)
        return row

    def swa_occupancy(self) -> float:
        s = self.alloc.stats()
        return 1 - s["swa_free"] / s["swa_total"]

    def batch(self, mode: ForwardMode, rows: list[int], q_lens: list[int]) -> ForwardBatch:
        prefix = [self.alloc.allocated_len(r) for r in rows]
        locs = torch.cat([self.alloc.extend(r, q) for r, q in zip(rows, q_lens)])
        return ForwardBatch.build(mode, rows, prefix, [[0] * q for q in q_lens], locs, self.r2t, [])

    def qkv(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = torch.randn(num_tokens, H * D, generator=self.gen)
        k = torch.randn(num_tokens, HKV * D, generator=self.gen)
        v = torch.randn(num_tokens, HKV * D, generator=self.gen)
        return q, k, v

    def run(self, backend, pool, batch: ForwardBatch, qkv, layers=None) -> list[torch.Tensor]:
        """One forward of every layer (each writes its new KV, then attends)."""
        q, k, v = qkv
        backend.init_forward_metadata(batch, pool)
        return [backend.forward(layer, q, k, v) for layer in (layers or self.layers)]

    def reference(self, pool, batch: ForwardBatch, qkv) -> list[torch.Tensor]:
        return self.run(create_backend("torch_native", torch.device("cpu")), pool, batch, qkv)
