"""Reference attention: gathers each request's KV from the pool and does float32 math.

It is the oracle every other backend is compared with, so it is written for clarity: explicit
causal and sliding-window masks, logit soft-capping and attention sinks, the requests of a
forward attended together, padded to their longest query and key runs (`padded_groups`; the
padding is masked out). SWA layers read keys through a full->SWA translation; which slots each
request reads and its mask are made once per forward and layer kind, not once a layer. An FP8
cache is read dequantised with the pool's scales of the KV layer read (docs/design.md §4.7).
"""

from __future__ import annotations

import dataclasses

import torch

from attention.base import AttentionBackend, AttentionLayer
from attention.batch import AttentionBatch
from attention.dense import causal_window_mask, dense_attention, padded_groups
from attention.kv_pool import FP8_E4M3, KVPool, dequantize


@dataclasses.dataclass
class _RequestKV:
    q_start: int
    q_end: int
    full_locs: torch.Tensor  # full slots of positions [0, seq_len)
    swa_first_pos: int  # first position whose SWA slot is gathered
    swa_locs: torch.Tensor | None  # SWA slots of positions [swa_first_pos, seq_len)


@dataclasses.dataclass
class _Group:
    """Requests attended in one product, `[B, m]` queries against `[B, n]` keys."""

    q_rows: torch.Tensor  # [B, m] rows of q (padding: the group's first row)
    pages: torch.Tensor  # [B, n] pages of the keys read (padding: page 0)
    offsets: torch.Tensor  # [B, n] their offsets in the page
    mask: torch.Tensor  # [B, m, n]
    real: torch.Tensor  # [B, m] the queries that are not padding
    evicted: str | None  # an SWA read of an evicted slot: what was read


@dataclasses.dataclass
class _Metadata:
    pool: KVPool
    batch: AttentionBatch
    requests: list[_RequestKV]
    swa_out_loc: torch.Tensor | None  # SWA write slots of this forward's tokens, made once
    groups: dict[tuple[bool, int | None], list[_Group]] = dataclasses.field(default_factory=dict)


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
        q = q.view(num_tokens, layer.num_heads, layer.head_dim)
        out = torch.empty_like(q)
        key = (is_swa, layer.sliding_window)
        if key not in md.groups:
            md.groups[key] = [self._group(md, members, *key) for members in padded_groups(*self._lens(md, is_swa))]
        for group in md.groups[key]:
            if group.evicted is not None:
                raise RuntimeError(
                    f"torch_native: layer {layer.layer_id} would read an evicted SWA slot ({group.evicted})"
                )
            keys = dequantize(kv_buf[group.pages, 0, :, group.offsets, :], k_scale)
            values = dequantize(kv_buf[group.pages, 1, :, group.offsets, :], v_scale)
            attended = dense_attention(
                q[group.q_rows], keys, values, group.mask, layer.scaling, layer.logit_softcap, layer.sinks
            )
            out[group.q_rows[group.real]] = attended[group.real].to(q.dtype)
        return out.view(num_tokens, layer.num_heads * layer.head_dim)

    @staticmethod
    def _lens(md: _Metadata, is_swa: bool) -> tuple[list[int], list[int]]:
        """Each request's query and key counts for a layer of this kind."""
        requests = md.requests
        kv = [(r.swa_locs if is_swa and r.swa_locs is not None else r.full_locs).shape[0] for r in requests]
        return [r.q_end - r.q_start for r in requests], kv

    @staticmethod
    def _group(md: _Metadata, members: list[int], is_swa: bool, window: int | None) -> _Group:
        """The slots `members` read in a layer of this kind, their masks and rows, padded."""
        requests = [md.requests[i] for i in members]
        page_size, device = md.pool.page_size, md.batch.positions.device
        runs = [(r.swa_locs, r.swa_first_pos) if is_swa else (r.full_locs, 0) for r in requests]
        m = max(r.q_end - r.q_start for r in requests)
        n = max(locs.shape[0] for locs, _ in runs)
        locs_padded = torch.zeros(len(requests), n, dtype=torch.long, device=device)
        mask = torch.zeros(len(requests), m, n, dtype=torch.bool, device=device)
        q_rows = torch.full((len(requests), m), requests[0].q_start, dtype=torch.long, device=device)
        real = torch.zeros(len(requests), m, dtype=torch.bool, device=device)
        evicted = None
        for b, (req, (locs, first_pos)) in enumerate(zip(requests, runs)):
            q_len, kv_len = req.q_end - req.q_start, locs.shape[0]
            q_pos = md.batch.positions[req.q_start : req.q_end]
            kv_pos = torch.arange(first_pos, first_pos + kv_len, device=device)
            seen = causal_window_mask(q_pos, kv_pos, window)
            if is_swa and evicted is None and bool(((locs // page_size == 0) & seen.any(0)).any()):
                evicted = (
                    f"positions {first_pos}..{first_pos + kv_len - 1}, queries at "
                    f"{q_pos[0].item()}..{q_pos[-1].item()}, window {window}"
                )
            locs_padded[b, :kv_len] = locs
            mask[b, :q_len, :kv_len] = seen
            q_rows[b, :q_len] = torch.arange(req.q_start, req.q_end, device=device)
            real[b, :q_len] = True
        return _Group(q_rows, locs_padded // page_size, locs_padded % page_size, mask, real, evicted)
