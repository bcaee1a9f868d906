"""`ForwardBatch`: the tensors of one forward pass, built from the scheduler's plan.

Implements `attention.AttentionBatch`; the model and the sampler read the rest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from attention import ForwardMode


@dataclasses.dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    q_lens: torch.Tensor  # [B] int32
    seq_lens: torch.Tensor  # [B] int32, KV length including this forward's tokens
    q_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    out_cache_loc: torch.Tensor  # [T] int64, full-pool slots of the new tokens
    req_pool_indices: torch.Tensor  # [B] int64
    req_to_token: torch.Tensor  # [R, C] int32
    logits_indices: torch.Tensor  # rows of the hidden states whose logits are needed
    query_offset: int = 0  # see attention.AttentionBatch
    spec_hidden: torch.Tensor | None = None  # [T, *] hidden states a draft head reads per token
    attn_backend: Any = None  # set by the model runner for this forward

    @classmethod
    def build(
        cls,
        mode: ForwardMode,
        rows: Sequence[int],
        prefix_lens: Sequence[int],
        input_ids: Sequence[Sequence[int]],
        out_cache_loc: torch.Tensor,
        req_to_token: torch.Tensor,
        logits_rows: Sequence[int],
        query_offset: int = 0,
        spec_hidden: torch.Tensor | None = None,
    ) -> ForwardBatch:
        """`input_ids[i]` are request i's new tokens, at positions `prefix_lens[i]` onwards
        (shifted by `query_offset` for read-only queries past the KV); `logits_rows` lists
        (flattened) token rows whose logits the caller needs."""
        device = req_to_token.device
        q_lens = [len(ids) for ids in input_ids]
        seq_lens = [p + q for p, q in zip(prefix_lens, q_lens)]
        positions = [pos + query_offset for p, q in zip(prefix_lens, q_lens) for pos in range(p, p + q)]
        flat_ids = [t for ids in input_ids for t in ids]

        def tensor(values: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            forward_mode=mode,
            batch_size=len(rows),
            input_ids=tensor(flat_ids, torch.int64),
            positions=tensor(positions, torch.int64),
            q_lens=tensor(q_lens, torch.int32),
            seq_lens=tensor(seq_lens, torch.int32),
            q_lens_cpu=q_lens,
            seq_lens_cpu=seq_lens,
            out_cache_loc=out_cache_loc.to(device=device, dtype=torch.int64),
            req_pool_indices=tensor(list(rows), torch.int64),
            req_to_token=req_to_token,
            logits_indices=tensor(list(logits_rows), torch.int64),
            query_offset=query_offset,
            spec_hidden=spec_hidden,
        )
