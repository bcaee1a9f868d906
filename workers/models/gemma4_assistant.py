"""Gemma 4's assistant (`Gemma4AssistantForCausalLM`, transformers' `gemma4_assistant`) as a
frozen-KV MTP draft (docs/design.md §6).

What one draft step computes, as transformers does:
- `pre_projection([target embedding of the token, state])` (2 x the target's hidden size -> its
  own): the first draft of a round reads the target's final-norm hidden state of the position
  before the pending token, later drafts the assistant's own state;
- Gemma 4 layers with query projections only: each attends the KV of the target's last
  KV-producing layer of its type (sliding or full), so its `AttentionLayer.layer_id` is that
  target layer, read through the target's pool handed to every forward (§4.2);
- its final norm, then `post_projection` back to the target's hidden size: the state the next
  draft reads; logits of the normed state through its own LM head, not soft-capped.

Every draft of a round sits at the pending token's position (transformers' `position_ids`) and
reads the same target KV: a full layer all of it, a sliding layer of window W the W + 1 keys
before that position (transformers' window mask for the assistant is |q - k| <= W). So its
sliding layers carry window W + 2 (a query one past the KV end sees that window less itself),
and the allocator keeps SWA slots for it.

With `use_ordered_embeddings` the LM head is a centroid head (`CentroidHead`): each row scores
only the tokens of its `centroid_intermediate_top_k` best of `num_centroids` centroids, and hands
on their target ids beside the logits (`ForwardOutput.ids`), as a draft vocabulary does.

Checkpoint names: `pre_projection.weight`, `post_projection.weight`, `model.layers.N.*` (Gemma 4
layers without k/v projections), `model.norm.weight`, `model.embed_tokens.weight` (the LM head
when tied, otherwise `lm_head.weight`), `masked_embedding.centroids.weight` and
`masked_embedding.token_ordering`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from collections.abc import Iterable

import torch
from torch import nn
from transformers import AutoConfig

from attention import AttentionLayer
from workers.distributed import TPGroup
from workers.forward_batch import ForwardBatch
from workers.models.config import LayerConfig, ModelConfig, model_config_from_hf
from workers.models.decoder import STACKED_PARAMS, CausalLM, RotaryTables, load_weights, run_layers
from workers.models.gemma4 import Gemma4DecoderLayer
from workers.models.layers import ParallelLMHead, ReplicatedLinear, RMSNorm, default_weight_loader

ARCHITECTURE = "Gemma4AssistantForCausalLM"
MODEL_TYPE = "gemma4_assistant"
# Keys a sliding layer of window W sees before the assistant's query, beyond the W - 1 a token
# at that position sees: transformers' |q - k| <= W.
EXTRA_WINDOW = 2


@dataclasses.dataclass(frozen=True)
class AssistantConfig:
    """An assistant's shapes, checked against its target's."""

    cfg: ModelConfig  # its layers: its own widths, the target's KV layers they read (`kv_layer`)
    backbone_hidden_size: int  # the target's hidden size: the state it reads and hands on
    num_centroids: int  # 0: a full LM head
    centroid_top_k: int


def is_assistant(model_dir: str) -> bool:
    """Whether a draft checkpoint is a Gemma 4 assistant (its config.json's architectures or
    model_type); False when there is no readable config.json."""
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError, TypeError):
        return False
    return isinstance(raw, dict) and (
        ARCHITECTURE in (raw.get("architectures") or []) or raw.get("model_type") == MODEL_TYPE
    )


def assistant_config(model_dir: str, target: ModelConfig) -> AssistantConfig:
    """Read an assistant's config.json and check it against the target (a Gemma 4 model of its
    hidden size and vocabulary, whose KV layers have the assistant's head shapes); raise
    ValueError naming the field."""
    if target.arch.model != "gemma4":
        raise ValueError(
            f"speculative.draft_model: a Gemma 4 assistant drafts for Gemma 4 targets, not {target.architecture}"
        )
    try:
        hf = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except Exception as exc:  # transformers' own checks (their own types)
        raise ValueError(f"speculative.draft_model: config.json in {model_dir!r} is not usable: {exc}") from exc
    if hf.backbone_hidden_size != target.hidden_size:
        raise ValueError(
            f"speculative.draft_model: backbone_hidden_size {hf.backbone_hidden_size} differs from the "
            f"target's hidden_size {target.hidden_size}"
        )
    text = copy.deepcopy(hf.get_text_config())
    text.num_kv_shared_layers = 0  # every layer reads the target's KV, none stores its own
    own = model_config_from_hf(text, architecture="Gemma4ForCausalLM")
    if own.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative.draft_model: vocabulary of {own.vocab_size} tokens, the target has {target.vocab_size}"
        )
    layers = tuple(_reading_target(i, layer, target) for i, layer in enumerate(own.layers))
    centroids = hf.num_centroids if hf.use_ordered_embeddings else 0
    top_k = hf.centroid_intermediate_top_k
    if centroids and (own.vocab_size % centroids or not 1 <= top_k <= centroids):
        raise ValueError(
            f"speculative.draft_model: num_centroids {centroids} must divide the vocabulary ({own.vocab_size}) and "
            f"centroid_intermediate_top_k {top_k} lie in [1, num_centroids]"
        )
    cfg = dataclasses.replace(own, layers=layers, final_logit_softcap=None)
    return AssistantConfig(cfg, hf.backbone_hidden_size, centroids, top_k)


def _reading_target(i: int, layer: LayerConfig, target: ModelConfig) -> LayerConfig:
    """Assistant layer i's geometry reading the target's last KV-producing layer of its type."""
    sliding = layer.sliding_window is not None
    kind = "sliding-window" if sliding else "full"
    last = max((j for j, t in enumerate(target.layers) if (t.sliding_window is not None) == sliding), default=None)
    if last is None:
        raise ValueError(
            f"speculative.draft_model: assistant layer {i} reads a {kind} attention layer; the target has none"
        )
    source = target.layers[last].kv_layer
    theirs = target.layers[source]
    if (layer.head_dim, layer.num_kv_heads) != (theirs.head_dim, theirs.num_kv_heads):
        raise ValueError(
            f"speculative.draft_model: assistant layer {i} ({kind} attention) has head_dim {layer.head_dim} and "
            f"{layer.num_kv_heads} KV heads; target layer {source}, whose KV it reads, has {theirs.head_dim} and "
            f"{theirs.num_kv_heads}"
        )
    window = layer.sliding_window + EXTRA_WINDOW if sliding else None
    return dataclasses.replace(layer, sliding_window=window, kv_layer=source, k_eq_v=False)


class CentroidHead(nn.Module):
    """Logits over the tokens of each row's `top_k` best centroids only (transformers'
    `Gemma4AssistantMaskedEmbedder`): `vocab / num_centroids` tokens a centroid, listed by
    `token_ordering`. The LM-head rows are kept in that order, so a row's tokens are `top_k`
    blocks gathered through index tensors: static shapes and nothing read on the host, as a CUDA
    graph needs. Returns the logits and the target ids of their columns."""

    def __init__(self, vocab_size: int, hidden_size: int, num_centroids: int, top_k: int) -> None:
        super().__init__()
        self.centroids = ReplicatedLinear(hidden_size, num_centroids, bias=False)
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]
        self.register_buffer("token_ordering", torch.arange(vocab_size), persistent=False)
        self.top_k = top_k
        self.block = vocab_size // num_centroids

    def put_in_order(self, ordering: torch.Tensor) -> None:
        """Take the checkpoint's `token_ordering` (every token id once) and reorder the LM-head
        rows, loaded in token order, into it."""
        vocab = self.weight.shape[0]
        ordering = ordering.to(self.token_ordering.device, torch.int64)
        every = torch.arange(vocab, device=ordering.device)
        if ordering.shape != (vocab,) or not torch.equal(ordering.sort().values, every):
            raise ValueError(f"weights: masked_embedding.token_ordering must list each of the {vocab} token ids once")
        self.token_ordering.copy_(ordering)
        self.weight.data.copy_(self.weight.data[ordering])

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 logits `[T, top_k * block]`, their target ids `[T, top_k * block]`)."""
        n, h = hidden.shape
        top = self.centroids(hidden).topk(self.top_k, dim=-1).indices  # [T, top_k]
        rows = self.weight.view(-1, self.block, h)[top].view(n, -1, h)
        logits = torch.bmm(rows, hidden[:, :, None]).squeeze(-1)
        return logits.float(), self.token_ordering.view(-1, self.block)[top].view(n, -1)


class AssistantLayers(nn.Module):
    """The assistant's layers, final norm and RoPE tables (checkpoint prefix `model.`)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Gemma4DecoderLayer(cfg, i, tp, reads_kv_only=True) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.arch.norm_one_plus)
        self.rotary = RotaryTables(cfg)


class Gemma4Assistant(nn.Module):
    drafts_in_place = True  # every draft of a round at the pending token's position, on the same KV

    def __init__(self, ac: AssistantConfig, target: CausalLM, tp: TPGroup) -> None:
        super().__init__()
        cfg = self.cfg = ac.cfg
        h, backbone = cfg.hidden_size, ac.backbone_hidden_size
        self._target = [target]  # a plain list: the target's parameters are not the assistant's
        self.handed_on_size = backbone
        self.pre_projection = ReplicatedLinear(2 * backbone, h, bias=False)
        self.model = AssistantLayers(cfg, tp)
        self.post_projection = ReplicatedLinear(h, backbone, bias=False)
        self.masked_embedding: CentroidHead | None = None
        self.lm_head: nn.Module | None = None
        if ac.num_centroids:
            self.masked_embedding = CentroidHead(cfg.vocab_size, h, ac.num_centroids, ac.centroid_top_k)
        else:
            self.lm_head = ParallelLMHead(cfg.vocab_size, h, tp)

    @property
    def attention_layers(self) -> list[AttentionLayer]:
        return [layer.self_attn.attn for layer in self.model.layers]

    @property
    def scores_subset(self) -> bool:
        """Whether each row's logits cover a subset of the vocabulary of its own (`subset_logits`)."""
        return self.masked_embedding is not None

    def forward(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(final-norm hidden states for the logits, the projected state the next draft reads)."""
        embeds = self._target[0].model.embed(batch.input_ids)
        hidden = self.pre_projection(torch.cat([embeds, batch.spec_hidden.to(embeds.dtype)], dim=-1))
        rope = self.model.rotary(batch.positions)
        hidden = run_layers(self.model.layers, hidden, None, rope, batch).final_norm(self.model.norm)
        return hidden, self.post_projection(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits over the vocabulary (or a hot-token list's rows of it)."""
        return self.lm_head.logits(hidden).float()

    def subset_logits(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The centroid head's logits and the target ids of their columns, per row."""
        return self.masked_embedding(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The checkpoint's tensors; the LM head is `lm_head.weight` when given, otherwise the
        tied `model.embed_tokens.weight` (the assistant embeds with the target's table)."""
        head = "masked_embedding.weight" if self.masked_embedding is not None else "lm_head.weight"
        rest, tables, ordering = [], {}, None
        for name, tensor in weights:
            if name in ("lm_head.weight", "model.embed_tokens.weight"):
                tables[name] = tensor
            elif name == "masked_embedding.token_ordering":
                ordering = tensor
            else:
                rest.append((name, tensor))
        table = tables.get("lm_head.weight", tables.get("model.embed_tokens.weight"))
        if table is not None:
            rest.append((head, table))
        if (ordering is not None) != (self.masked_embedding is not None):
            state = "given" if ordering is not None else "missing"
            raise ValueError(
                f"weights: masked_embedding.token_ordering {state}, but use_ordered_embeddings is "
                f"{self.masked_embedding is not None}"
            )
        gate_up = tuple(s for s in STACKED_PARAMS if s[0] == "gate_up_proj")
        load_weights(self, rest, ARCHITECTURE, stacked=gate_up)
        if self.masked_embedding is not None:
            self.masked_embedding.put_in_order(ordering)
