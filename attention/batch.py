"""The read-only view of a batch that attention backends consume.

`workers.forward_batch.ForwardBatch` implements it. Backends must not rely on anything else
about the batch: what they need per forward they derive from these fields in
`init_forward_metadata`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np
import torch

from attention.forward_mode import ForwardMode


class HostIndices(Protocol):
    req_pool_indices: np.ndarray  # [B] int64
    out_cache_loc: np.ndarray  # [T] int64


@runtime_checkable
class AttentionBatch(Protocol):
    forward_mode: ForwardMode
    batch_size: int
    # Query tokens are laid out request after request; request i owns rows
    # [cu_q_lens[i], cu_q_lens[i+1]) of q/k/v.
    q_lens_cpu: list[int]  # new tokens per request
    seq_lens_cpu: list[int]  # KV length *including* this forward's new tokens
    positions: torch.Tensor  # [T] int64, position of every query token
    out_cache_loc: torch.Tensor  # [T] int64, full-pool slot each new token's KV is written to
    req_pool_indices: torch.Tensor  # [B] int64, row of each request in req_to_token
    req_to_token: torch.Tensor  # [R, C] int32, full-pool slot of every token of every request
    # Read-only queries that sit this many positions past the end of their request's KV
    # (frozen-KV draft steps: the drafts themselves have no KV). 0 for every other forward:
    # then each request's queries are the last q_len positions of its KV.
    query_offset: int
    # The host's master copy of req_to_token (None only for batches that never reach a paged
    # backend) and the batch's rows and write slots on the host: backends build their metadata
    # there and upload it in one copy instead of launching kernels for it.
    req_to_token_host: np.ndarray | None
    host: HostIndices | None


def upload(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on the device: shared memory on the CPU, one pinned copy on a GPU."""
    host = torch.from_numpy(values)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)
