"""`ForwardBatch`: the tensors of one forward pass, built from the scheduler's plan.

Implements `attention.AttentionBatch`; the model and the sampler read the rest. The integer
inputs are laid out on the host first (`HostInputs`, numpy) and reach the device in one copy;
a CUDA-graph replay reads the host arrays to fill its own static buffers instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from attention import ForwardMode
from attention.batch import upload
from workers.memory.req_to_token import ReqToTokenPool


@dataclasses.dataclass
class HostInputs:
    """The batch's integer inputs on the host (int64)."""

    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    out_cache_loc: np.ndarray  # [T]
    req_pool_indices: np.ndarray  # [B]
    logits_indices: np.ndarray  # [L]


@dataclasses.dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    q_lens_cpu: list[int]
    seq_lens_cpu: list[int]  # KV length including this forward's tokens
    out_cache_loc: torch.Tensor  # [T] int64, full-pool slots of the new tokens
    req_pool_indices: torch.Tensor  # [B] int64
    req_to_token: torch.Tensor  # [R, C] int32
    logits_indices: torch.Tensor  # rows of the hidden states whose logits are needed
    query_offset: int = 0  # see attention.AttentionBatch
    spec_hidden: torch.Tensor | None = None  # [T, *] hidden states a draft head reads per token
    attn_backend: Any = None  # set by the model runner for this forward
    host: HostInputs | None = None
    req_to_token_host: np.ndarray | None = None  # the host master of req_to_token
    ids_on_device: bool = False  # input_ids come from the device (overlapped decoding); host ids are placeholders

    @classmethod
    def build(
        cls,
        mode: ForwardMode,
        rows: Sequence[int],
        prefix_lens: Sequence[int],
        input_ids: Sequence[Sequence[int]],
        out_cache_loc: torch.Tensor,
        req_to_token: ReqToTokenPool,
        logits_rows: Sequence[int],
        query_offset: int = 0,
        spec_hidden: torch.Tensor | None = None,
    ) -> ForwardBatch:
        """`input_ids[i]` are request i's new tokens, at positions `prefix_lens[i]` onwards
        (shifted by `query_offset` for read-only queries past the KV); `logits_rows` lists
        (flattened) token rows whose logits the caller needs."""
        q_lens = [len(ids) for ids in input_ids]
        seq_lens = [p + q for p, q in zip(prefix_lens, q_lens)]
        starts = np.repeat(np.asarray(prefix_lens, dtype=np.int64) + query_offset, q_lens)
        firsts = np.cumsum(q_lens, dtype=np.int64) - q_lens  # each request's first row
        within = np.arange(len(starts), dtype=np.int64) - np.repeat(firsts, q_lens)
        host = HostInputs(
            input_ids=np.fromiter((t for ids in input_ids for t in ids), dtype=np.int64, count=len(starts)),
            positions=starts + within,
            out_cache_loc=out_cache_loc.numpy().astype(np.int64, copy=False),
            req_pool_indices=np.asarray(rows, dtype=np.int64),
            logits_indices=np.asarray(logits_rows, dtype=np.int64),
        )
        parts = [host.input_ids, host.positions, host.out_cache_loc, host.req_pool_indices, host.logits_indices]
        packed = upload(np.concatenate(parts), req_to_token.table.device)
        ids, pos, loc, rows_t, logits = packed.split([len(p) for p in parts])
        return cls(
            forward_mode=mode,
            batch_size=len(rows),
            input_ids=ids,
            positions=pos,
            q_lens_cpu=q_lens,
            seq_lens_cpu=seq_lens,
            out_cache_loc=loc,
            req_pool_indices=rows_t,
            req_to_token=req_to_token.table,
            req_to_token_host=req_to_token.host,
            logits_indices=logits,
            query_offset=query_offset,
            spec_hidden=spec_hidden,
            host=host,
        )

    def use_device_ids(self, ids: torch.Tensor) -> None:
        """Take the input ids from the device (tokens sampled by an earlier forward that the host
        has not read): the host ids become placeholders and no device-to-host copy is needed."""
        if ids.shape != self.input_ids.shape:
            raise ValueError(
                f"device input ids of shape {tuple(ids.shape)} for a batch of {tuple(self.input_ids.shape)}"
            )
        self.input_ids = ids
        self.ids_on_device = True
