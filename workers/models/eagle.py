"""EAGLE draft heads in the EAGLE-1 and EAGLE-3 checkpoint layouts.

An EAGLE head reads the target's hidden states. Its entry at draft position i consumes token
i + 1 and the target's hidden state at position i and predicts token i + 2, so its KV lives at
the same slots as the target's KV of position i.

- EAGLE-1 (`LlamaForCausalLMEagle`): `fc` (2h -> h, with bias) over [embedding, target final
  hidden state], then Llama decoder layers (the first without its input norm); no final norm;
  logits through the target's LM head. Checkpoint names: `fc.*`, `layers.N.*`.
- EAGLE-3 (`LlamaForCausalLMEagle3`): `fc` (3 h_target -> h) over three target layers' outputs
  (`eagle_aux_hidden_state_layer_ids`), one `midlayer` whose attention reads
  [norm(embedding), norm(hidden)] (2h wide), a final norm and its own LM head over a draft
  vocabulary mapped to the target's by `d2t` (draft id + d2t[id] = target id).

Embeddings and LM heads the checkpoint omits are the target's.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig

from attention import AttentionLayer
from workers.distributed import TPGroup
from workers.forward_batch import ForwardBatch
from workers.models.config import ModelConfig, model_config_from_hf
from workers.models.decoder import (
    MLP,
    CausalLM,
    DecoderLayer,
    RotaryTables,
    SelfAttention,
    load_weights,
    run_layers,
)
from workers.models.layers import ParallelLMHead, ReplicatedLinear, RMSNorm, VocabParallelEmbedding

EAGLE_ARCHITECTURES = {
    "LlamaForCausalLMEagle": 1,
    "EagleLlamaForCausalLM": 1,
    "LlamaForCausalLMEagle3": 3,
    "Eagle3LlamaForCausalLM": 3,
}


@dataclasses.dataclass(frozen=True)
class EagleConfig:
    version: int  # 1 or 3
    cfg: ModelConfig  # the head's Llama layer shapes
    checkpoint_names: frozenset[str]
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]  # EAGLE-3: target layers whose outputs feed `fc`
    fc_bias: bool


def _checkpoint_names(model_dir: str) -> frozenset[str]:
    from workers.models.loader import safetensors_files

    names = set()
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            names.update(f.keys())
    return frozenset(names)


def load_eagle_config(model_dir: str, target: ModelConfig, load_format: str = "auto") -> EagleConfig:
    """Read an EAGLE head's config.json and check it against the target."""
    raw: dict[str, Any] = json.load(open(os.path.join(model_dir, "config.json")))
    archs = [a for a in raw.get("architectures") or [] if a in EAGLE_ARCHITECTURES]
    if not archs:
        raise ValueError(
            f"speculative.draft_model: architectures {raw.get('architectures')} is not an EAGLE head "
            f"({sorted(EAGLE_ARCHITECTURES)})"
        )
    version = EAGLE_ARCHITECTURES[archs[0]]
    hf = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    cfg = model_config_from_hf(hf, model_dir, architecture="LlamaForCausalLM")
    if cfg.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative.draft_model: vocabulary of {cfg.vocab_size} tokens, the target has {target.vocab_size}"
        )
    eagle = raw.get("eagle_config") or {}
    aux = eagle.get("eagle_aux_hidden_state_layer_ids") or raw.get("eagle_aux_hidden_state_layer_ids")
    if version == 3:
        n = target.num_layers
        aux = tuple(aux) if aux else (1, n // 2 - 1, n - 4)
        if len(aux) != 3 or not all(0 <= i < n for i in aux):
            raise ValueError(
                f"speculative.draft_model: eagle_aux_hidden_state_layer_ids {list(aux)} must name three of "
                f"the target's {n} layers"
            )
        if cfg.num_layers != 1:
            raise ValueError(
                f"speculative.draft_model: EAGLE-3 heads with {cfg.num_layers} layers are not supported (1)"
            )
    names = _checkpoint_names(model_dir) if load_format != "dummy" else frozenset()
    return EagleConfig(
        version=version,
        cfg=cfg,
        checkpoint_names=names,
        draft_vocab_size=raw.get("draft_vocab_size") or cfg.vocab_size,
        aux_layer_ids=tuple(aux) if version == 3 else (),
        fc_bias=bool(raw.get("bias", version == 1)),
    )


class EagleHead(nn.Module):
    def __init__(self, ec: EagleConfig, target: CausalLM, tp: TPGroup) -> None:
        super().__init__()
        cfg = self.cfg = ec.cfg
        self.version = ec.version
        h = cfg.hidden_size
        self._target = [target]  # a plain list: the target's parameters are not the head's
        own_embed = "embed_tokens.weight" in ec.checkpoint_names
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, h, tp) if own_embed else None
        self.rotary = RotaryTables(cfg)
        if ec.version == 1:
            self.fc = ReplicatedLinear(2 * h, h, bias=ec.fc_bias)
            self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp, input_norm=i > 0) for i in range(cfg.num_layers))
        else:
            self.fc = ReplicatedLinear(3 * target.cfg.hidden_size, h, bias=ec.fc_bias)
            self.midlayer = Eagle3Layer(cfg, tp)
            self.norm = RMSNorm(h, cfg.rms_norm_eps, gemma=False)
        # EAGLE-3 checkpoints carry their own head (over the draft vocabulary); so do dummy ones.
        own_head = "lm_head.weight" in ec.checkpoint_names or (ec.version == 3 and not ec.checkpoint_names)
        self.lm_head = ParallelLMHead(ec.draft_vocab_size, h, tp) if own_head else None
        if ec.draft_vocab_size != cfg.vocab_size:
            if self.lm_head is None:
                raise ValueError("speculative.draft_model: a draft vocabulary needs the head's own lm_head.weight")
            self.register_buffer("draft_to_target", torch.arange(ec.draft_vocab_size), persistent=False)
        else:
            self.draft_to_target = None

    @property
    def attention_layers(self) -> list[AttentionLayer]:
        if self.version == 1:
            return [layer.self_attn.attn for layer in self.layers]
        return [self.midlayer.self_attn.attn]

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return (self.embed_tokens or self._target[0].model.embed_tokens)(input_ids)

    def forward(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden states for logits, hidden states for the next draft step)."""
        embeds = self._embed(batch.input_ids)
        rope = self.rotary(batch.positions)
        hidden = batch.spec_hidden.to(embeds.dtype)
        if self.version == 1:
            hidden = run_layers(self.layers, self.fc(torch.cat([embeds, hidden], dim=-1)), None, rope, batch).stream()
            return hidden, hidden
        if hidden.shape[-1] != self.cfg.hidden_size:  # target layers' outputs; draft steps pass their own
            hidden = self.fc(hidden)
        residual = self.midlayer(embeds, hidden, rope, batch)
        return self.norm(residual), residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary (`draft_to_target` maps them to target ids): a
        greedy draft step takes its argmax there, a fraction of the target's vocabulary."""
        head = self.lm_head or self._target[0].lm_head
        return head.logits(hidden).float()

    def load_weights(self, weights) -> None:
        rest = []
        for name, tensor in weights:
            if name == "d2t":
                if self.draft_to_target is None:
                    raise ValueError("weights: d2t given but the head's draft vocabulary is the target's")
                self.draft_to_target.copy_(torch.arange(tensor.shape[0], device=tensor.device) + tensor.long())
            elif name != "t2d":
                rest.append((name, tensor))
        load_weights(self, rest, f"EAGLE-{self.version} head", rename={"model.": ""})


class Eagle3Layer(nn.Module):
    """EAGLE-3's midlayer: attention over [norm(embedding), norm(hidden)], residual on hidden."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps, gemma=False)
        self.hidden_norm = RMSNorm(h, eps, gemma=False)
        self.self_attn = SelfAttention(cfg, 0, tp, input_size=2 * h)
        self.post_attention_layernorm = RMSNorm(h, eps, gemma=False)
        self.mlp = MLP(cfg, tp)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, rope: dict, batch: ForwardBatch) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        residual = hidden + self.self_attn(x, rope, batch)
        keep = batch.kept_rows()  # (the feed-forward of a batch pruned to its logits rows: theirs alone)
        if keep is not None:
            residual = residual.index_select(0, keep)
        return residual + self.mlp(self.post_attention_layernorm(residual))
