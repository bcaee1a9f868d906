"""Gemma 4 (dense, text): the Gemma decoder with per-layer embeddings, KV sharing and two
attention geometries in one model (docs/design.md §4.6).

What differs from Gemma 3, and where it lives:
- Each layer's attention geometry is data (`LayerConfig`: head size, KV heads, the KV layer it
  reads, V taken from the K projection), applied by the shared `SelfAttention`; values are
  RMS-normalised without a weight before they are stored, the query scale is 1 and every norm
  scales by w, not 1 + w (`ArchSpec`).
- Per-layer embeddings: a second token embedding table (`embed_tokens_per_layer`, vocabulary x
  layers x width) plus a projection of the token's embedding, combined once per forward
  (`per_layer_inputs`) and fed to each layer's gated branch after its MLP. The table lives with
  the other weights on the model's device (Gemma-4-E2B's is 4.7 GB in bf16); each token reads
  one row of it, so its weight is marked `read_by_row` for whatever counts the bytes a step
  reads (`ops/bench/decode_throughput.py`).
- Each layer ends with a learned scalar times its whole output stream. The layer hands the
  next its last norm's input, the stream before that norm and the scalar (`output_norm`,
  `output_scale`): the next layer's input norm applies norm, add, scalar and its own norm in
  one kernel (the final norm after the last layer too).
- The per-layer input branch reads the stream after the MLP: that stream and the gate's
  projection of it come from one kernel, and the activation times the per-layer input is
  computed inside the kernel of the projection back (`ReplicatedLinear.after_add`, `gated`).
- The last `num_kv_shared_layers` layers have only a query projection and read the KV of an
  earlier layer (`SelfAttention` with `kv_layer`); with `use_double_wide_mlp` their MLPs are
  twice as wide.
- With `enable_moe_block` (26B-A4B) every layer's MLP runs beside a mixture of experts
  (`workers/models/moe.py`): the router reads the stream before the MLP, the experts its own
  norm of it (`pre_feedforward_layernorm_2`), and the two branches, each normed
  (`post_feedforward_layernorm_1`, `_2`), add up to the block's output (both norms and the add
  one kernel on CUDA: `RMSNorm.added_to`), which the layer's post-feedforward norm takes as it
  takes the dense MLP's.
- Multimodal checkpoints (`Gemma4ForConditionalGeneration`) load their language model only.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from workers.distributed import TPGroup
from workers.forward_batch import ForwardBatch
from workers.models.config import ModelConfig
from workers.models.decoder import (
    MLP,
    CausalLM,
    DecoderLayer,
    DecoderModel,
    RopeInputs,
    TokenIds,
    load_weights,
    run_layers,
)
from workers.models.layers import (
    ReplicatedLinear,
    RMSNorm,
    Unreduced,
    VocabParallelEmbedding,
    default_weight_loader,
    reduced,
)
from workers.models.moe import Experts, Router
from workers.models.ops import scale_rows

logger = logging.getLogger(__name__)

# A KV-sharing layer's tensors that checkpoints may carry and it does not use.
UNUSED_SHARED_KV = ("k_proj", "v_proj", "k_norm", "v_norm")


class Gemma4DecoderLayer(DecoderLayer):
    """A Gemma decoder layer, then the per-layer-input branch and the layer's scalar:
    `stream = (s + norm(up(act(gate(s)) * per_layer_input))) * layer_scalar`, returned as
    `(up(...), s)` for the next layer's input norm to finish (`output_norm`, `output_scale`).
    `reads_kv_only`: a query-only layer whatever its config says (the Gemma 4 assistant's,
    reading the target's KV)."""

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup, reads_kv_only: bool = False) -> None:
        wide = cfg.double_wide_mlp and cfg.layers[layer_id].kv_layer != layer_id
        mlp = MLP(cfg, tp, cfg.intermediate_size * (2 if wide else 1))
        super().__init__(cfg, layer_id, tp, reads_kv_only=reads_kv_only, mlp=mlp)
        h, width, eps = cfg.hidden_size, cfg.per_layer_input_size, cfg.rms_norm_eps
        self.act = cfg.hidden_act
        if width:
            self.per_layer_input_gate = ReplicatedLinear(h, width, bias=False)
            self.per_layer_projection = ReplicatedLinear(width, h, bias=False)
            self.post_per_layer_input_norm = RMSNorm(h, eps, False)
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)
        self.layer_scalar.weight_loader = default_weight_loader  # type: ignore[attr-defined]
        self.layer_scalar.identity = 1.0  # type: ignore[attr-defined]  # its value in random-weight models
        # registered again after the norm it names, so that its parameter keeps the norm's name
        del self.output_norm
        self.output_norm = self.post_per_layer_input_norm if width else self.post_feedforward_layernorm
        self.output_scale = self.layer_scalar
        if cfg.moe is not None:
            self.router = Router(h, cfg.moe, eps)
            self.experts = Experts(h, cfg.moe, tp)
            one_plus = cfg.arch.norm_one_plus
            self.pre_feedforward_layernorm_2 = RMSNorm(h, eps, one_plus)
            self.post_feedforward_layernorm_1 = RMSNorm(h, eps, one_plus)
            self.post_feedforward_layernorm_2 = RMSNorm(h, eps, one_plus)

    def forward(  # type: ignore[override]
        self,
        hidden: torch.Tensor | Unreduced | TokenIds,
        residual: torch.Tensor | None,
        rope: RopeInputs,
        batch: ForwardBatch,
        before: RMSNorm | None = None,
        scale: torch.Tensor | None = None,
        per_layer_input: torch.Tensor | None = None,
        keep: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | Unreduced, torch.Tensor]:
        """(out, residual) as `DecoderLayer.forward` (`keep` too); `per_layer_input`: this
        layer's row of the per-layer inputs (models with them)."""
        out, residual = super().forward(hidden, residual, rope, batch, before, scale, keep)
        if keep is not None and per_layer_input is not None:
            per_layer_input = per_layer_input.index_select(0, keep)
        if hasattr(self, "experts"):
            out = reduced(out)
            routing = self.router(residual)  # first: the experts' norm runs between (`routed_early`)
            normed = self.pre_feedforward_layernorm_2(residual)
            experts = self.experts(normed, *routing, routed_early=True)
            out = self.post_feedforward_layernorm_1.added_to(out, experts, self.post_feedforward_layernorm_2)
        if not hasattr(self, "per_layer_input_gate"):
            return out, residual
        gate, residual = self.per_layer_input_gate.after_add(out, residual, self.post_feedforward_layernorm)
        return self.per_layer_projection.gated(gate, per_layer_input, self.act), residual


class Gemma4Model(DecoderModel):
    layer_class = Gemma4DecoderLayer

    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__(cfg, tp)
        width = cfg.per_layer_input_size
        if width:
            packed = cfg.num_layers * width
            self.embed_tokens_per_layer = VocabParallelEmbedding(cfg.per_layer_vocab_size, packed, tp)
            self.embed_tokens_per_layer.weight.read_by_row = True  # type: ignore[attr-defined]
            self.per_layer_model_projection = ReplicatedLinear(cfg.hidden_size, packed, bias=False)
            self.per_layer_projection_norm = RMSNorm(width, cfg.rms_norm_eps, False)

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """`[T, layers, width]`: each token's row of the per-layer table (scaled by sqrt(width))
        and the normed projection of its embedding (scaled by 1/sqrt(hidden)), averaged over
        sqrt(2) as Hugging Face combines them."""
        cfg = self.cfg
        shape = (-1, cfg.num_layers, cfg.per_layer_input_size)
        rows = scale_rows(self.embed_tokens_per_layer(input_ids), cfg.per_layer_input_size**0.5).view(shape)
        projected = self.per_layer_model_projection(embeds) * cfg.hidden_size**-0.5
        return (self.per_layer_projection_norm(projected.view(shape)) + rows) * 2.0**-0.5

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(final-norm hidden states, captured layer outputs concatenated or None)."""
        if self.cfg.per_layer_input_size:
            hidden = self.embed(input_ids)
            per_layer = self.per_layer_inputs(input_ids, hidden)
        else:
            hidden, per_layer = self._first_input(input_ids), None
        end = run_layers(self.layers, hidden, None, self.rotary(positions), batch, self.capture_layers, per_layer)
        return end.final_norm(self.norm), self.captured(end)


class Gemma4CausalLM(CausalLM):
    model_class = Gemma4Model

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The text model's tensors (a multimodal checkpoint's under `model.<text_prefix>.`);
        a KV-sharing layer's unused K/V tensors are skipped."""
        cfg = self.cfg
        prefix = f"model.{cfg.arch.text_prefix}." if cfg.arch.text_prefix else "model."
        skip = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
        skip |= {
            f"{prefix}layers.{i}.self_attn.{part}.{kind}"
            for i, layer in enumerate(cfg.layers)
            if layer.kv_layer != i
            for part in UNUSED_SHARED_KV
            for kind in ("weight", "bias")
        }
        rename = {prefix: "model."} if cfg.arch.text_prefix else None
        load_weights(self, self._text_only(weights, prefix), cfg.architecture, rename=rename, skip=skip)

    def _text_only(
        self, weights: Iterable[tuple[str, torch.Tensor]], prefix: str
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's text-model tensors (and the LM head); the others (vision, audio)
        are counted and named in one log line."""
        left_out: dict[str, int] = {}
        for name, tensor in weights:
            if name.startswith(prefix) or not name.startswith("model."):
                yield name, tensor
            else:
                part = ".".join(name.split(".")[:2])
                left_out[part] = left_out.get(part, 0) + 1
        if left_out:
            logger.info(
                "weights: %d tensors outside the text model left out (%s); slidespec serves text only",
                sum(left_out.values()),
                ", ".join(f"{k}: {n}" for k, n in sorted(left_out.items())),
            )
