"""Frozen-KV multi-token-prediction (MTP) draft head.

The head owns no KV cache. Each of its layers reads the KV that one target layer wrote (a
config field, `kv_source_layers`; by default the target's last sliding-window and last
full-attention layers) and has only a query projection: a draft query at position p attends
the verified tokens' KV that a token at p would see, frozen while drafting.

Input of the first draft step: [norm(embedding of the pending token), norm(target hidden state
of the position before it)] through `fc` (2h -> h); later steps feed the head's own output.
Layers follow the target's architecture (norms, soft-caps, RoPE of the layer they read);
embedding and logits are the target's. Checkpoint names: `pre_fc_norm_embedding.weight`,
`pre_fc_norm_hidden.weight`, `fc.weight`, `layers.N.self_attn.{q_proj,o_proj,q_norm}.*`,
`layers.N.{mlp,*_layernorm}.*`, `norm.weight`; config.json adds `architectures:
["FrozenKVMTPForCausalLM"]`, `kv_source_layers` and `intermediate_size` to the target's shapes.
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch
from torch import nn

from attention import AttentionLayer
from workers.distributed import TPGroup
from workers.forward_batch import ForwardBatch
from workers.models.config import ModelConfig
from workers.models.decoder import STACKED_PARAMS, CausalLM, DecoderLayer, RotaryTables, load_weights, run_layers
from workers.models.layers import ReplicatedLinear, RMSNorm

ARCHITECTURE = "FrozenKVMTPForCausalLM"


def default_kv_source_layers(target: ModelConfig) -> list[int]:
    """The last sliding-window layer and the last full-attention layer of the target."""
    windows = target.layer_windows
    last = [
        max((i for i, w in windows.items() if (w is not None) == sliding), default=None) for sliding in (True, False)
    ]
    return [i for i in last if i is not None]


def frozen_kv_config(model_dir: str, target: ModelConfig) -> tuple[ModelConfig, list[int]]:
    """(the head's layer shapes: the target's with the head's MLP width, source layer ids)."""
    raw = json.load(open(os.path.join(model_dir, "config.json")))
    if ARCHITECTURE not in (raw.get("architectures") or []):
        raise ValueError(
            f"speculative.draft_model: architectures {raw.get('architectures')} is not a frozen-KV MTP draft "
            f"({ARCHITECTURE} or Gemma4AssistantForCausalLM)"
        )
    sources = raw.get("kv_source_layers") or default_kv_source_layers(target)
    bad = [i for i in sources if not isinstance(i, int) or not 0 <= i < target.num_layers]
    if bad:
        raise ValueError(
            f"speculative.draft_model: kv_source_layers {bad} are not layers of the target (0..{target.num_layers - 1})"
        )
    for key in ("hidden_size", "vocab_size", "head_dim", "num_attention_heads", "num_key_value_heads"):
        ours = getattr(
            target, {"num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads"}.get(key, key)
        )
        if key in raw and raw[key] != ours:
            raise ValueError(f"speculative.draft_model: {key} {raw[key]} differs from the target's {ours}")
    cfg = dataclasses.replace(target, intermediate_size=raw.get("intermediate_size", target.intermediate_size))
    return cfg, list(sources)


class FrozenKVMTPHead(nn.Module):
    def __init__(self, cfg: ModelConfig, kv_source_layers: list[int], target: CausalLM, tp: TPGroup) -> None:
        super().__init__()
        self.cfg = cfg
        h, eps, gemma = cfg.hidden_size, cfg.rms_norm_eps, cfg.arch.norm_one_plus
        self._target = [target]  # a plain list: the target's parameters are not the head's
        self.pre_fc_norm_embedding = RMSNorm(h, eps, gemma)
        self.pre_fc_norm_hidden = RMSNorm(h, eps, gemma)
        self.fc = ReplicatedLinear(2 * h, h, bias=False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, src, tp, reads_kv_only=True) for src in kv_source_layers)
        self.norm = RMSNorm(h, eps, gemma)
        self.rotary = RotaryTables(cfg)
        self.lm_head: nn.Module | None = None  # the target's, unless a hot-token map gives one

    @property
    def attention_layers(self) -> list[AttentionLayer]:
        return [layer.self_attn.attn for layer in self.layers]

    def forward(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        target = self._target[0]
        embeds = target.model.embed(batch.input_ids)
        hidden = self.fc(
            torch.cat(
                [self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(batch.spec_hidden.to(embeds.dtype))],
                dim=-1,
            )
        )
        hidden = run_layers(self.layers, hidden, None, self.rotary(batch.positions), batch).final_norm(self.norm)
        return hidden, hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._target[0].compute_logits(hidden, self.lm_head)

    def load_weights(self, weights) -> None:
        gate_up = tuple(s for s in STACKED_PARAMS if s[0] == "gate_up_proj")
        load_weights(self, weights, ARCHITECTURE, stacked=gate_up)
