"""Runs one model's forward: owns the model, its KV pool and its attention backend."""

from __future__ import annotations

import dataclasses

import torch

from attention import create_backend
from workers.distributed import SINGLE_RANK, TPGroup
from workers.forward_batch import ForwardBatch
from workers.memory import KVAllocator, build_pool
from workers.models import ModelConfig, build_model


@dataclasses.dataclass
class ForwardOutput:
    logits: torch.Tensor  # [len(logits_indices), vocab] float32
    hidden: torch.Tensor  # [T, hidden], final-norm hidden states of every token


class ModelRunner:
    def __init__(
        self,
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
    ) -> None:
        self.cfg = cfg
        self.device = device
        self.model = build_model(cfg, model_dir, load_format, dtype, device, tp, seed)
        attn = self.model.model.layers[0].self_attn.attn
        # The pool is chosen from this model's own layers; the allocator may be shared with
        # another model (DESIGN.md §4, invariant 1).
        self.pool = build_pool(cfg.layer_windows, allocator, attn.num_kv_heads, attn.head_dim, dtype, device, use_swa_pool)
        self.backend = create_backend(attention_backend, device, debug_kv_checks=debug_kv_checks)
        self.backend.prepare([layer.self_attn.attn for layer in self.model.model.layers], allocator.page_size)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        batch.attn_backend = self.backend
        self.backend.init_forward_metadata(batch, self.pool)
        hidden = self.model(batch.input_ids, batch.positions, batch)
        return ForwardOutput(self.model.compute_logits(hidden[batch.logits_indices]), hidden)
