"""Runs one model's forward: owns the model, its KV pool and its attention backend."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from attention import AttentionLayer, KVPool, create_backend
from workers.cuda_graphs import CudaGraphRunner
from workers.distributed import SINGLE_RANK, TPGroup
from workers.forward_batch import ForwardBatch, ForwardOutput
from workers.memory import KVAllocator, build_pool, kv_layouts
from workers.models import ModelConfig, build_model
from workers.step_record import ForwardRecord


class RunnableModel(Protocol):
    """What a model runner drives: targets (`CausalLM`) and draft heads alike. A head whose
    rows each score a subset of the vocabulary of their own sets `scores_subset` and scores with
    `subset_logits(hidden) -> (logits, target ids of their columns)` instead (a centroid head)."""

    attention_layers: list[AttentionLayer]

    def forward(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class ModelRunner:
    """A model, the KV pool its layers read and write (None when a pool is handed to every
    forward: frozen-KV drafts read the target's), and its own attention backend."""

    def __init__(
        self,
        model: nn.Module,
        pool: KVPool | None,
        attention_backend: str,
        device: torch.device,
        page_size: int,
        debug_kv_checks: bool = False,
        role: str = "target",
        allocator: KVAllocator | None = None,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        """`allocator`: the one whose tables this model's forwards read (flushed to the device
        before each forward); `kv_dtype`: the dtype of the KV it reads (its pool's, or the
        target's for a draft reading that), None: the model's."""
        self.model = model
        self.pool = pool
        self.allocator = allocator
        self.graphs: CudaGraphRunner | None = None
        self.device = device
        self.role = role  # "target" or "draft", in forward records
        self.recorder: Callable[[ForwardRecord], None] | None = None
        self.backend = create_backend(attention_backend, device, debug_kv_checks=debug_kv_checks)
        self.backend.prepare(model.attention_layers, page_size, kv_dtype)

    @classmethod
    def load(
        cls,
        cfg: ModelConfig,
        model_dir: str | None,
        allocator: KVAllocator,
        attention_backend: str,
        dtype: torch.dtype,
        device: torch.device,
        load_format: str = "auto",
        tp: TPGroup = SINGLE_RANK,
        use_swa_pool: bool = True,
        seed: int = 0,
        debug_kv_checks: bool = False,
        role: str = "target",
        kv_dtype: torch.dtype | None = None,
    ) -> ModelRunner:
        """A Hugging Face causal LM with its own pool on a (possibly shared) allocator, its KV in
        `kv_dtype` (None: the model's dtype)."""
        model = build_model(cfg, model_dir, load_format, dtype, device, tp, seed)
        # The pool is chosen from this model's own layers; the allocator may be shared with
        # another model (docs/design.md §4.1). Layers reading another's KV add nothing (§4.6).
        kv_dtype = kv_dtype or dtype
        pool = build_pool(kv_layouts(model.attention_layers), allocator, kv_dtype, device, use_swa_pool)
        return cls(
            model, pool, attention_backend, device, allocator.page_size, debug_kv_checks, role, allocator, kv_dtype
        )

    def enable_graphs(self, graphs: CudaGraphRunner) -> None:
        """Replay captured CUDA graphs for the forwards they cover (`workers/cuda_graphs.py`)."""
        self.graphs = graphs

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: KVPool | None = None) -> ForwardOutput:
        """One forward through `pool`, or this runner's own pool when none is given: a graph
        replay when one was captured for it, eager otherwise."""
        into = pool if pool is not None else self.pool
        graphed = self.graphs is not None and self.graphs.can_run(batch, into)
        pool, start = self._begin(batch, pool, not graphed or self.graphs.reads_tables(batch, into))
        if graphed:
            out = self.graphs.run(batch, pool)
        else:
            self.backend.init_forward_metadata(batch, pool)
            out = self.run_model(batch)
        self._record(batch, start, 1)
        return out

    @torch.inference_mode()
    def forward_ahead(self, batch: ForwardBatch, ahead: torch.Tensor, most: int) -> ForwardOutput | None:
        """`batch` with each row `ahead[i]` (device, at most `most`) positions further on than
        the host built it, in one graph replay; None when no graph was captured for it."""
        if self.graphs is None or not self.graphs.can_run(batch, self.pool):
            return None
        pool, start = self._begin(batch, None)
        out = self.graphs.run(batch, pool, ahead, most)
        self._record(batch, start, 1)
        return out

    @torch.inference_mode()
    def forward_chain(
        self,
        batch: ForwardBatch,
        steps: int,
        pool: KVPool | None = None,
        ahead: torch.Tensor | None = None,
        most: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`steps` greedy draft decode steps from `batch` (the first) in one graph replay: their
        tokens `[B, steps]` and the first step's hidden states, or None when no chain graph was
        captured for it. `ahead`: see `CudaGraphRunner.run_chain`."""
        if self.graphs is None or not self.graphs.can_run(batch, pool or self.pool, steps):
            return None
        pool, start = self._begin(batch, pool)
        out = self.graphs.run_chain(batch, pool, steps, ahead, most)
        self._record(batch, start, steps)
        return out

    def _begin(self, batch: ForwardBatch, pool: KVPool | None, reads_tables: bool = True) -> tuple[KVPool, int]:
        """The pool and start time of a forward; the allocator's device tables brought up to
        date first when the forward reads them (otherwise their changes wait for one that does)."""
        pool = pool if pool is not None else self.pool
        if pool is None:
            raise RuntimeError("model runner: this model owns no KV pool; pass the pool it reads")
        start = time.time_ns()
        if self.allocator is not None:
            self.allocator.flush(needed=reads_tables)
        batch.attn_backend = self.backend
        return pool, start

    def _record(self, batch: ForwardBatch, start: int, steps: int) -> None:
        if self.recorder is None:
            return
        mode = batch.forward_mode
        kernel = self.backend.kernel_name(mode) or ""
        self.recorder(
            ForwardRecord(
                self.role,
                mode.name,
                batch.batch_size,
                sum(batch.q_lens_cpu) * steps,
                kernel,
                start,
                time.time_ns(),
                steps,
            )
        )

    def run_model(self, batch: ForwardBatch, greedy: tuple[torch.Tensor, torch.Tensor] | None = None) -> ForwardOutput:
        """The model on a batch whose attention metadata is in place: float32 logits of the
        requested rows (and their columns' target ids, for a head scoring a subset of each row's
        own), hidden states handed on. What a CUDA graph captures. `greedy` (a target's greedy
        decode graph): buffers the logits and their argmax go to."""
        hidden, handed_on = self.model(batch)
        every = batch.prune_to_logits or batch.logits_of_every_row(hidden.shape[0])  # (pruned: the model kept them)
        rows = hidden if every else hidden[batch.logits_indices]
        if greedy is not None:
            return ForwardOutput(self.model.greedy_logits(rows, *greedy), handed_on)
        if getattr(self.model, "scores_subset", False):
            logits, ids = self.model.subset_logits(rows)
            return ForwardOutput(logits, handed_on, ids=ids)
        return ForwardOutput(self.model.compute_logits(rows), handed_on)
