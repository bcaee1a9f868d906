"""`ForwardBatch`: the tensors of one forward pass, built from the scheduler's plan, and
`ForwardOutput`, what the pass returns.

Implements `attention.AttentionBatch`; the model and the sampler read the rest. The integer
inputs are laid out on the host first (`HostInputs`, numpy) and reach the device in one copy
when an eager forward first reads them; a CUDA-graph replay stages the host arrays into its own
static buffers instead, and never uploads them.
"""

from __future__ import annotations

import dataclasses
import itertools
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
    every_row: bool = False  # logits_indices is 0..T-1 in order: a decode step's (no gather needed)


@dataclasses.dataclass
class DeviceInputs:
    """The batch's integer inputs on the device (int64)."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    out_cache_loc: torch.Tensor  # [T] full-pool slots of the new tokens
    req_pool_indices: torch.Tensor  # [B]
    logits_indices: torch.Tensor  # rows of the hidden states whose logits are needed


class _OnDevice:
    """A `DeviceInputs` field read through the batch: the first read uploads them all."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, batch: ForwardBatch | None, owner: type | None = None):
        if batch is None:
            return self
        return getattr(batch.device_inputs(), self.name)

    def __set__(self, batch: ForwardBatch, value: torch.Tensor) -> None:
        setattr(batch.device_inputs(), self.name, value)


@dataclasses.dataclass
class ForwardBatch:
    """A graph replay reads only `host` (and device ids): a batch reaches the device only when
    something reads its device inputs (an eager forward), in one copy then."""

    forward_mode: ForwardMode
    batch_size: int
    q_lens_cpu: list[int]
    seq_lens_cpu: list[int]  # KV length including this forward's tokens
    req_to_token: torch.Tensor  # [R, C] int32
    inputs: DeviceInputs | None = None  # None until read (uploaded from `host`)
    query_offset: int = 0  # see attention.AttentionBatch
    spec_hidden: torch.Tensor | None = None  # [T, *] hidden states a draft head reads per token
    attn_backend: Any = None  # set by the model runner for this forward
    host: HostInputs | None = None
    req_to_token_host: np.ndarray | None = None  # the host master of req_to_token
    # input ids on the device (overlapped decoding, speculative rounds): `ids[rows]` (all of
    # `ids` when rows is None); the host ids are placeholders then
    device_ids: tuple[torch.Tensor, np.ndarray | None] | None = None
    # a plain decode step of an engine keeping its target hidden states in a ring
    # (`workers/hidden_ring.py`): the row number of its first request's, the others' following
    hidden_at: int | None = None
    # the caller reads the model's outputs (logits, hidden states handed on) only at the logits
    # rows (a draft's catch-up: each request's last row, which proposes): the last layer's
    # feed-forward then runs on those rows alone, and the outputs are theirs, in logits order
    prune_to_logits: bool = False

    input_ids = _OnDevice()
    positions = _OnDevice()
    out_cache_loc = _OnDevice()
    req_pool_indices = _OnDevice()
    logits_indices = _OnDevice()

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
            input_ids=np.fromiter(itertools.chain.from_iterable(input_ids), dtype=np.int64, count=len(starts)),
            positions=starts + within,
            out_cache_loc=out_cache_loc.numpy().astype(np.int64, copy=False),
            req_pool_indices=np.asarray(rows, dtype=np.int64),
            logits_indices=np.asarray(logits_rows, dtype=np.int64),
            every_row=len(logits_rows) == len(starts) and list(logits_rows) == list(range(len(starts))),
        )
        return cls(
            forward_mode=mode,
            batch_size=len(rows),
            q_lens_cpu=q_lens,
            seq_lens_cpu=seq_lens,
            req_to_token=req_to_token.table,
            req_to_token_host=req_to_token.host,
            query_offset=query_offset,
            spec_hidden=spec_hidden,
            host=host,
        )

    def device_inputs(self) -> DeviceInputs:
        """The device inputs, uploaded from the host arrays in one copy on first use."""
        if self.inputs is None:
            if self.host is None:
                raise RuntimeError("forward batch: no device inputs and no host arrays to upload them from")
            host = self.host
            parts = [host.input_ids, host.positions, host.out_cache_loc, host.req_pool_indices, host.logits_indices]
            packed = upload(np.concatenate(parts), self.req_to_token.device)
            self.inputs = DeviceInputs(*packed.split([len(p) for p in parts]))
            if self.device_ids is not None:
                self.inputs.input_ids = self.device_input_ids()
        return self.inputs

    def kept_rows(self) -> torch.Tensor | None:
        """The rows the last layer's feed-forward runs on (`prune_to_logits`; None: all)."""
        return self.logits_indices if self.prune_to_logits else None

    def logits_of_every_row(self, rows: int) -> bool:
        """Whether the logits asked for are those of all `rows` token rows, in order (a decode
        step's: then no gather of the hidden states is needed)."""
        return self.host is not None and self.host.every_row and len(self.host.logits_indices) == rows

    @property
    def ids_on_device(self) -> bool:
        return self.device_ids is not None

    def use_device_ids(self, ids: torch.Tensor, rows: np.ndarray | None = None) -> None:
        """Take the input ids from the device, `ids[rows]` (tokens sampled by an earlier forward
        that the host has not read): the host ids become placeholders and no device-to-host
        copy is needed."""
        n = sum(self.q_lens_cpu)
        count = len(rows) if rows is not None else ids.shape[0]
        if ids.dim() != 1 or count != n:
            raise ValueError(f"device input ids: {count} of shape {tuple(ids.shape)} for a batch of {n} tokens")
        self.device_ids = (ids, rows)
        if self.inputs is not None:
            self.inputs.input_ids = self.device_input_ids()

    def device_input_ids(self) -> torch.Tensor:
        """The device input ids, gathered (`ids_on_device` batches)."""
        ids, rows = self.device_ids
        return ids if rows is None else ids[upload(np.asarray(rows, dtype=np.int64), ids.device)]


@dataclasses.dataclass
class ForwardOutput:
    logits: torch.Tensor  # [len(logits_indices), vocab] float32
    hidden: torch.Tensor | None  # [T, *], the hidden states this model hands on (None: a greedy decode graph's)
    tokens: torch.Tensor | None = None  # [T] the logits' argmax, when a greedy decode graph took it
    # [len(logits_indices), columns] the target id of each logits column, per row: a draft head
    # scoring a subset of the vocabulary of each row's own (`scores_subset`: a centroid head)
    ids: torch.Tensor | None = None
