"""Reference attention: gathers each request's KV from the pool and does float32 math.

It is the oracle every other backend is compared with, so it is written for clarity: one
request at a time, explicit causal and sliding-window masks, logit soft-capping and attention
sinks. SWA layers read keys through a full->SWA translation made once per forward. An FP8
cache is read dequantised with the pool's scales of the KV layer read (docs/design.md §4.7).
"""

from __future__ import annotations

import dataclasses

import torch

from attention.base import AttentionBackend, AttentionLayer
from attention.batch import AttentionBatch
from attention.dense import causal_window_mask, dense_attention
from attention.kv_pool import FP8_E4M3, KVPool, dequantize


@dataclasses.dataclass
class _RequestKV:
    q_start: int
    q_end: int
    full_locs: torch.Tensor  # full slots of positions [0, seq_len)
    swa_first_pos: int  # first position whose SWA slot is gathered
    swa_locs: torch.Tensor | None  # SWA slots of positions [swa_first_pos, seq_len)


@dataclasses.dataclass
class _Metadata:
    pool: KVPool
    batch: AttentionBatch
    requests: list[_RequestKV]
    swa_out_loc: torch.Tensor | None  # SWA write slots of this forward's tokens, made once


class TorchNativeBackend(AttentionBackend):
    name = "torch_native"

    def __init__(self, device: torch.device, debug_kv_checks: bool = False) -> None:
        super().__init__(device)
        self._md: _Metadata | None = None

    def init_forward_metadata(self, batch: AttentionBatch, pool: KVPool) -> None:
        requests = []
        q_start = 0
        positions = batch.positions.tolist() if batch.q_lens_cpu else []
        for i in range(batch.batch_size):
            q_len, seq_len = batch.q_lens_cpu[i], batch.seq_lens_cpu[i]
            row = batch.req_to_token[batch.req_pool_indices[i], :seq_len].long()
            swa_first, swa_locs = 0, None
            if pool.has_swa and q_len:
                swa_first = max(0, positions[q_start] - pool.swa_window + 1)
                swa_locs = pool.translate_full_to_swa(row[swa_first:])
            requests.append(_RequestKV(q_start, q_start + q_len, row, swa_first, swa_locs))
            q_start += q_len
        swa_out = pool.translate_full_to_swa(batch.out_cache_loc) if pool.has_swa else None
        self._md = _Metadata(pool, batch, requests, swa_out)

    def forward(
        self,
        layer: AttentionLayer,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
    ) -> torch.Tensor:
        md = self._md
        if md is None:
            raise RuntimeError("torch_native: forward() before init_forward_metadata()")
        pool, batch = md.pool, md.batch
        is_swa = pool.is_swa_layer(layer.layer_id)
        if is_swa and layer.sliding_window is None:
            raise RuntimeError(
                f"torch_native: layer {layer.layer_id} has no sliding window but its KV lives in the SWA pool"
            )
        num_tokens = q.shape[0]
        if k is not None:
            locs = md.swa_out_loc if is_swa else batch.out_cache_loc
            pool.set_kv(
                layer.layer_id,
                locs,
                k.view(num_tokens, layer.num_kv_heads, layer.head_dim),
                v.view(num_tokens, layer.num_kv_heads, layer.head_dim),
            )
        kv_buf = pool.kv_cache(layer.layer_id)
        k_scale, v_scale = pool.kv_scales(layer.layer_id) if kv_buf.dtype == FP8_E4M3 else (1.0, 1.0)
        page_size = pool.page_size
        q = q.view(num_tokens, layer.num_heads, layer.head_dim)
        out = torch.empty_like(q)
        for req in md.requests:
            if req.q_end == req.q_start:
                continue
            q_pos = batch.positions[req.q_start : req.q_end]
            if is_swa:
                locs, first_pos = req.swa_locs, req.swa_first_pos
            else:
                locs, first_pos = req.full_locs, 0
            kv_pos = torch.arange(first_pos, first_pos + locs.shape[0], device=q.device)
            mask = causal_window_mask(q_pos, kv_pos, layer.sliding_window)
            pages = torch.div(locs, page_size, rounding_mode="floor")
            if is_swa and bool(((pages == 0) & mask.any(0)).any()):
                raise RuntimeError(
                    f"torch_native: layer {layer.layer_id} would read an evicted SWA slot "
                    f"(positions {first_pos}..{first_pos + locs.shape[0] - 1}, queries at "
                    f"{q_pos[0].item()}..{q_pos[-1].item()}, window {layer.sliding_window})"
                )
            offs = locs % page_size
            keys = dequantize(kv_buf[pages, 0, :, offs, :], k_scale)
            values = dequantize(kv_buf[pages, 1, :, offs, :], v_scale)
            out[req.q_start : req.q_end] = dense_attention(
                q[req.q_start : req.q_end], keys, values, mask, layer.scaling, layer.logit_softcap, layer.sinks
            ).to(q.dtype)
        return out.view(num_tokens, layer.num_heads * layer.head_dim)
