"""Dense attention for training: whole sequences, no KV pool, autograd flows through it.

Each batch row is one sequence of the same length starting at position 0. A layer that writes
K/V stores them (detached) under its layer id, so a frozen-KV draft layer run afterwards through
the same backend reads what the target layer computed, with the `query_offset` semantics of
inference: a query at position p sees the keys at positions <= p - offset inside its window.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attention.base import AttentionBackend, AttentionLayer
from attention.batch import AttentionBatch
from attention.kv_pool import KVPool


class TrainingBackend(AttentionBackend):
    name = "training"

    def __init__(self, device: torch.device, debug_kv_checks: bool = False) -> None:
        super().__init__(device)
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._batch: AttentionBatch | None = None

    def init_forward_metadata(self, batch: AttentionBatch, pool: KVPool | None) -> None:
        if len(set(batch.q_lens_cpu)) != 1:
            raise ValueError(f"training batches hold sequences of one length, got {sorted(set(batch.q_lens_cpu))}")
        self._batch = batch

    def forward(
        self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None
    ) -> torch.Tensor:
        batch = self._batch
        b, t = batch.batch_size, batch.q_lens_cpu[0]
        h, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
        if layer.logit_softcap is not None or layer.sinks is not None:
            raise ValueError(f"layer {layer.layer_id}: the training backend has no soft-cap or sinks")
        q = q.view(b, t, h, d).transpose(1, 2)
        if k is not None:
            k = k.view(b, t, hkv, d).transpose(1, 2)
            v = v.view(b, t, hkv, d).transpose(1, 2)
            self.kv[layer.layer_id] = (k.detach(), v.detach())
        else:
            k, v = self.kv[layer.layer_id]
        pos = torch.arange(t, device=q.device)
        offset = batch.query_offset
        mask = pos[None, :] <= pos[:, None] - offset
        if layer.sliding_window is not None:
            mask &= pos[None, :] > pos[:, None] - layer.sliding_window
        mask[:offset, 0] = True  # queries with no visible key: attend key 0 (callers drop these rows)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=layer.scaling, enable_gqa=hkv != h)
        return out.transpose(1, 2).reshape(b * t, h * d)
