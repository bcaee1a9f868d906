"""The decoder-only transformer behind every supported architecture.

Llama, Qwen2, Qwen3 and Mistral are the plain pre-norm decoder; Gemma 2 and 3 add sandwich
norms, a sqrt(hidden) embedding scale and soft-caps. `ModelConfig.arch` switches these on.
Parameter names follow the Hugging Face checkpoints (with q/k/v and gate/up fused).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import torch
from torch import nn

from attention import AttentionLayer
from attention.kernels.calls import Rotary
from workers.distributed import TPGroup
from workers.forward_batch import ForwardBatch
from workers.models import fp8
from workers.models.config import ModelConfig
from workers.models.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    Unreduced,
    VocabParallelEmbedding,
    head_param,
    reduced,
    rope_cache,
)
from workers.models.ops import QKNorms, float_logits, ops_for, scale_rows

# Checkpoint tensors that are stacked into one fused parameter: (fused, checkpoint, shard id).
STACKED_PARAMS = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


class SelfAttention(nn.Module):
    """Attention of decoder layer `layer_id` of `cfg`, in that layer's geometry (`cfg.layers`).

    `input_size` overrides the width fed to the q/k/v projection (EAGLE-3 feeds 2 x hidden).
    With `reads_kv_only`, or when the layer reads another layer's KV (`LayerConfig.kv_layer`:
    KV sharing), the layer has only a query projection and attends KV that layer wrote:
    frozen-KV draft layers read layer `layer_id` of the target. Architectures with attention
    sinks (gpt-oss) hold this rank's heads' sink logits (`sinks`), which every backend reads
    from the `AttentionLayer`. Each method's `reduce=False` returns the output projection's
    partial sums (`Unreduced`), for the norm after the block to all-reduce.
    """

    def __init__(
        self, cfg: ModelConfig, layer_id: int, tp: TPGroup, input_size: int | None = None, reads_kv_only: bool = False
    ) -> None:
        super().__init__()
        layer = cfg.layers[layer_id]
        input_size = input_size or cfg.hidden_size
        head_dim, eps, one_plus = layer.head_dim, cfg.rms_norm_eps, cfg.arch.norm_one_plus
        num_heads, num_kv_heads = QKVParallelLinear.local_heads(cfg.num_heads, layer.num_kv_heads, tp)
        if reads_kv_only or layer.kv_layer != layer_id:
            self.qkv_proj = None
            self.q_proj = ColumnParallelLinear(input_size, [cfg.num_heads * head_dim], cfg.qkv_bias, tp)
        else:
            shards = ("q", "k") if layer.k_eq_v else ("q", "k", "v")
            self.qkv_proj = QKVParallelLinear(
                input_size, head_dim, cfg.num_heads, layer.num_kv_heads, cfg.qkv_bias, tp, shards
            )
        self.o_proj = RowParallelLinear(cfg.num_heads * head_dim, cfg.hidden_size, cfg.o_bias, tp)
        if cfg.arch.qk_norm:
            self.q_norm = RMSNorm(head_dim, eps, one_plus)
            if self.qkv_proj is not None:
                self.k_norm = RMSNorm(head_dim, eps, one_plus)
        self.v_norm = RMSNorm(head_dim, eps, False, scaled=False) if cfg.arch.v_norm else None
        self.rope_key = layer.rope_key
        self.attn = AttentionLayer(
            layer_id=layer.kv_layer,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            scaling=cfg.scaling,
            sliding_window=layer.sliding_window,
            logit_softcap=cfg.attn_logit_softcap,
        )
        if cfg.arch.sinks:
            self.sinks = head_param(cfg.num_heads, tp)
            self.attn.sinks = self.sinks

    @property
    def projection(self) -> ColumnParallelLinear:
        """The input projection: fused q/k/v, or the query's alone (a layer reading another's KV)."""
        return self.qkv_proj if self.qkv_proj is not None else self.q_proj

    def forward(
        self, hidden: torch.Tensor, rope: RopeInputs, batch: ForwardBatch, reduce: bool = True
    ) -> torch.Tensor | Unreduced:
        return self._attend(self.projection(hidden), rope, batch, reduce)

    def after_norm(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor,
        norm: RMSNorm,
        before: RMSNorm | None,
        rope: RopeInputs,
        batch: ForwardBatch,
        reduce: bool = True,
        scale: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | Unreduced, torch.Tensor]:
        """`forward(norm.add(hidden, residual, before, scale)[0])` and the residual stream, the
        norm inside the input projection where the device fuses it; `hidden` may be the previous
        block's partial sums (`ColumnParallelLinear.after_norm`)."""
        projected, residual = self.projection.after_norm(hidden, residual, norm, before, scale)
        return self._attend(projected, rope, batch, reduce), residual

    def after_embedding(
        self, tokens: TokenIds, norm: RMSNorm, rope: RopeInputs, batch: ForwardBatch, reduce: bool = True
    ) -> tuple[torch.Tensor | Unreduced, torch.Tensor]:
        """`forward` of the normed embedding rows of `tokens`, and those rows (the residual
        stream's start): embedding, scale and norm inside the QKV projection where the device
        fuses them."""
        qkv, residual = self.qkv_proj.after_embedding(tokens.ids, tokens.table, tokens.scale, norm)
        return self._attend(qkv, rope, batch, reduce), residual

    def _attend(
        self, projected: torch.Tensor, rope: RopeInputs, batch: ForwardBatch, reduce: bool
    ) -> torch.Tensor | Unreduced:
        """Attention from the input projection's output (`projection`) to the output projection."""
        a = self.attn
        positions, cache = rope.positions, rope.caches[self.rope_key]
        if self.qkv_proj is None:
            q = projected.reshape(-1, a.num_heads, a.head_dim)
            rotary = Rotary(positions, cache, self._norms())
            out = batch.attn_backend.forward_rotating(a, q, None, None, rotary)
            if out is None:
                q, _ = ops_for(q).rope(positions, q, None, cache, rotary.norms)
                out = batch.attn_backend.forward(a, q.reshape(q.shape[0], -1), None, None)
            return self.o_proj(out, reduce)
        q, k, v = self.qkv_proj.split(projected)
        q = q.reshape(-1, a.num_heads, a.head_dim)
        k = k.reshape(-1, a.num_kv_heads, a.head_dim)
        # RoPE, the norms and the K/V write inside the attention kernel where the backend's does them
        rotary = Rotary(positions, cache, self._norms(), None if self.v_norm is None else self.v_norm.eps)
        out = batch.attn_backend.forward_rotating(a, q, k, v.reshape(k.shape), rotary)
        if out is not None:
            return self.o_proj(out, reduce)
        # K and V straight into the paged cache where the backend names the slots, V normed there
        dest = batch.attn_backend.kv_destination(a)
        v_norm_eps = None if self.v_norm is None or dest is None else self.v_norm.eps
        if self.v_norm is not None and dest is None:  # V may be K's projection: normed apart, in whole rows
            v = self.v_norm(v.reshape(k.shape).contiguous()).reshape(v.shape[0], -1)
        kv = None if dest is None else (dest.cache, dest.slots, v, dest.scales)
        q, k = ops_for(q).rope(positions, q, k, cache, rotary.norms, kv, v_norm_eps)
        if dest is not None:
            return self.o_proj(batch.attn_backend.forward(a, q.reshape(q.shape[0], -1), None, None), reduce)
        out = batch.attn_backend.forward(a, q.reshape(q.shape[0], -1), k.reshape(k.shape[0], -1), v)
        return self.o_proj(out, reduce)

    def _norms(self) -> QKNorms | None:
        """The per-head q/k norms RoPE applies first (qk-norm models), or None."""
        if not hasattr(self, "q_norm"):
            return None
        k_norm = getattr(self, "k_norm", None)
        return self.q_norm.weight, None if k_norm is None else k_norm.weight, self.q_norm.eps, self.q_norm.gemma


class MLP(nn.Module):
    """The gated feed-forward block, `intermediate_size` wide (default: the config's);
    `reduce=False`: the down projection's partial sums (`Unreduced`)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, intermediate_size: int | None = None) -> None:
        super().__init__()
        width = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [width] * 2, cfg.mlp_bias, tp)
        self.down_proj = RowParallelLinear(width, cfg.hidden_size, cfg.mlp_bias, tp)
        self.act = cfg.hidden_act

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor | Unreduced:
        return self.down_proj(self.gate_up_proj.act_and_mul(x, self.act), reduce)


class DecoderLayer(nn.Module):
    """A pre-norm decoder layer (Gemma: sandwich norms). `input_norm=False` drops the norm
    before attention (EAGLE-1's first layer).

    Layers pass the residual stream beside their output, so that each residual add is fused
    into the norm that follows it: `layer(x, residual, before, scale) -> (out, residual)`, where
    the stream after the layer is `(output_norm(out) + residual) * output_scale` (`out +
    residual` without an output norm, unscaled without an output scale; `residual` is None before
    the first layer). A Gemma layer's last norm (after its MLP) is such an output norm, Gemma 4's
    layer scalar such a scale: the next layer's input norm applies them (`before`, `scale`), one
    kernel for norm, add, scale and norm (`run_layers`). Under tensor parallelism the attention
    and MLP outputs leave their blocks as partial sums (`Unreduced`, `out` too), so that the
    norm after each can all-reduce them in its own kernel (`TPGroup.all_reduce_add_rms_norm`).

    `mlp`: the feed-forward block when it is not the config's gated MLP (Gemma 4's double-wide
    ones, a mixture of experts), taking `reduce` as `MLP` does."""

    def __init__(
        self,
        cfg: ModelConfig,
        layer_id: int,
        tp: TPGroup,
        reads_kv_only: bool = False,
        input_norm: bool = True,
        mlp: nn.Module | None = None,
    ) -> None:
        super().__init__()
        gemma, h, eps, one_plus = cfg.arch.gemma, cfg.hidden_size, cfg.rms_norm_eps, cfg.arch.norm_one_plus
        self.gemma = gemma
        self.self_attn = SelfAttention(cfg, layer_id, tp, reads_kv_only=reads_kv_only)
        self.mlp = mlp if mlp is not None else MLP(cfg, tp)
        self.input_layernorm = RMSNorm(h, eps, one_plus) if input_norm else None
        # Llama: the norm before the MLP. Gemma: the norm after attention (sandwich).
        self.post_attention_layernorm = RMSNorm(h, eps, one_plus)
        self.output_norm: RMSNorm | None = None
        self.output_scale: torch.Tensor | None = None
        if gemma:
            self.pre_feedforward_layernorm = RMSNorm(h, eps, one_plus)
            self.post_feedforward_layernorm = RMSNorm(h, eps, one_plus)
            self.output_norm = self.post_feedforward_layernorm

    @property
    def embeds_tokens(self) -> bool:
        """Whether the input norm runs inside the fused QKV projection, which can then start
        from `TokenIds`, embedding them itself."""
        return self.input_layernorm is not None and self.self_attn.qkv_proj is not None

    def forward(
        self,
        hidden: torch.Tensor | Unreduced | TokenIds,
        residual: torch.Tensor | None,
        rope: RopeInputs,
        batch: ForwardBatch,
        before: RMSNorm | None = None,
        scale: torch.Tensor | None = None,
        keep: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | Unreduced, torch.Tensor]:
        """`keep`: the rows the feed-forward runs on and the layer returns (all: None); every
        row's K and V are written all the same."""
        if isinstance(hidden, TokenIds):
            attn, residual = self.self_attn.after_embedding(hidden, self.input_layernorm, rope, batch, reduce=False)
        elif self.input_layernorm is not None and residual is not None:
            attn, residual = self.self_attn.after_norm(
                hidden, residual, self.input_layernorm, before, rope, batch, reduce=False, scale=scale
            )
        else:
            if self.input_layernorm is not None:
                hidden, residual = self.input_layernorm.add(hidden, residual, before, scale)
            else:
                hidden = residual = stream(hidden, residual, before, scale)
            attn = self.self_attn(hidden, rope, batch, reduce=False)
        if self.gemma:
            hidden, residual = self.pre_feedforward_layernorm.add(attn, residual, self.post_attention_layernorm)
        else:
            hidden, residual = self.post_attention_layernorm.add(attn, residual)
        if keep is not None:
            hidden, residual = hidden.index_select(0, keep), residual.index_select(0, keep)
        return self.mlp(hidden, reduce=False), residual


def stream(
    hidden: torch.Tensor | Unreduced,
    residual: torch.Tensor | None,
    norm: RMSNorm | None,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The residual stream after a layer: `(norm(hidden) + residual) * scale` (no norm: `hidden`;
    no residual yet: the first layer's input; no scale: 1), `hidden` all-reduced first if it is
    not yet."""
    hidden = reduced(hidden)
    hidden = norm(hidden) if norm is not None else hidden
    hidden = hidden if residual is None else residual + hidden
    return hidden if scale is None else hidden * scale


@dataclasses.dataclass
class LayersOut:
    """The end of `run_layers`: the stream after the last layer is `stream(out, residual, norm,
    scale)` (`out` maybe partial sums, `Unreduced`), for the final norm to take in one kernel
    (`final_norm`); `captured`: the streams after the layers numbered in `capture`."""

    out: torch.Tensor | Unreduced
    residual: torch.Tensor
    norm: RMSNorm | None
    scale: torch.Tensor | None
    captured: dict[int, torch.Tensor]

    def final_norm(self, norm: RMSNorm) -> torch.Tensor:
        """`norm` of the stream after the last layer."""
        return norm.add(self.out, self.residual, self.norm, self.scale)[0]

    def stream(self) -> torch.Tensor:
        """The stream after the last layer."""
        return stream(self.out, self.residual, self.norm, self.scale)


def run_layers(
    layers: Iterable[DecoderLayer],
    hidden: torch.Tensor | TokenIds,
    residual: torch.Tensor | None,
    rope: RopeInputs,
    batch: ForwardBatch,
    capture: tuple[int, ...] = (),
    per_layer: torch.Tensor | None = None,
) -> LayersOut:
    """Layers in order over the residual stream; `per_layer`: each layer's own input beside the
    stream (`[T, layers, width]`, Gemma 4's per-layer inputs), the i-th layer's `[:, i]`. A
    batch pruned to its logits rows (`ForwardBatch.prune_to_logits`) runs the last layer's
    feed-forward on those rows alone (after every row's attention has written its K and V): the
    stream it returns holds those rows (the captured streams, of earlier layers, every row)."""
    layers = list(layers)
    keep, last = batch.kept_rows(), len(layers) - 1
    before, scale, captured = None, None, {}
    for i, layer in enumerate(layers):
        extra = () if per_layer is None else (per_layer[:, i],)
        hidden, residual = layer(hidden, residual, rope, batch, before, scale, *extra, keep=keep if i == last else None)
        before, scale = layer.output_norm, layer.output_scale
        if i in capture:
            hidden = reduced(hidden)  # the next layer takes it reduced: partial sums reduce once
            captured[i] = stream(hidden, residual, before, scale)
    return LayersOut(hidden, residual, before, scale, captured)


@dataclasses.dataclass
class TokenIds:
    """A first layer's input before its embedding (`DecoderLayer.embeds_tokens`): the layer
    reads the rows itself, inside its QKV projection where the device fuses it."""

    ids: torch.Tensor
    table: torch.Tensor
    scale: float


@dataclasses.dataclass
class RopeInputs:
    """What every layer's RoPE reads in one forward: the positions and each variant's cache."""

    positions: torch.Tensor
    caches: dict[str, torch.Tensor]


class RotaryTables(nn.Module):
    """cos/sin caches of every RoPE variant of a config (`rope_cache`), for positions below
    `max_positions`: the model's `max_position_embeddings` at first."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.max_positions = 0
        device = torch.get_default_device()
        for key in cfg.rope:  # empty on this device until `cover` fills them
            self.register_buffer(f"cos_sin_{key}", torch.empty(0, device=device), persistent=False)
        self.cover(cfg.max_position_embeddings)

    def cover(self, positions: int) -> None:
        """Tables for every position below `positions`: a speculative round's drafts and a step
        launched ahead run past a request's last position, up to the engine's context length
        plus that lookahead (the RoPE kernels index the tables unchecked). Before graphs
        capture the buffers."""
        if positions <= self.max_positions:
            return
        self.max_positions = positions
        for key, rope in self.cfg.rope.items():
            old = getattr(self, f"cos_sin_{key}")
            setattr(self, f"cos_sin_{key}", rope_cache(rope.inv_freq.to(old.device), rope.attention_scaling, positions))

    def forward(self, positions: torch.Tensor) -> RopeInputs:
        return RopeInputs(positions, {key: getattr(self, f"cos_sin_{key}") for key in self.cfg.rope})


class DecoderModel(nn.Module):
    layer_class: type[DecoderLayer] = DecoderLayer

    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(self.layer_class(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.arch.norm_one_plus)
        self.rotary = RotaryTables(cfg)
        # Layers whose outputs (residual stream) are returned too: EAGLE-3 drafts read them.
        self.capture_layers: tuple[int, ...] = ()
        self.embed_scale = cfg.hidden_size**0.5 if cfg.arch.gemma else 1.0

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return scale_rows(self.embed_tokens(input_ids), self.embed_scale)

    def _first_input(self, input_ids: torch.Tensor) -> torch.Tensor | TokenIds:
        """The ids for a first layer that embeds them itself (one rank's whole table), else their
        embedding."""
        if self.embed_tokens.tp.size == 1 and self.layers[0].embeds_tokens:
            return TokenIds(input_ids, self.embed_tokens.weight, self.embed_scale)
        return self.embed(input_ids)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(final-norm hidden states, captured layer outputs concatenated or None)."""
        end = run_layers(
            self.layers, self._first_input(input_ids), None, self.rotary(positions), batch, self.capture_layers
        )
        return end.final_norm(self.norm), self.captured(end)

    def captured(self, end: LayersOut) -> torch.Tensor | None:
        """The captured layers' streams side by side, or None."""
        return torch.cat([end.captured[i] for i in self.capture_layers], dim=-1) if end.captured else None


class CausalLM(nn.Module):
    """Decoder plus vocabulary-parallel LM head; `compute_logits` returns float32 logits."""

    model_class: type[DecoderModel] = DecoderModel

    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = self.model_class(cfg, tp)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def attention_layers(self) -> list[AttentionLayer]:
        return [layer.self_attn.attn for layer in self.model.layers]

    @property
    def handed_on_size(self) -> int:
        """Width of the hidden states `forward` hands to a draft model."""
        return self.cfg.hidden_size * max(1, len(self.model.capture_layers))

    def forward(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden states for logits, hidden states handed to a draft model): the final-norm
        states, or the captured layer outputs when `model.capture_layers` is set."""
        hidden, captured = self.model(batch.input_ids, batch.positions, batch)
        return hidden, hidden if captured is None else captured

    def compute_logits(self, hidden: torch.Tensor, head: nn.Module | None = None) -> torch.Tensor:
        """Float32 logits, soft-capped as this model's are; `head`: other LM-head rows to score
        with (a draft's hot-token head) instead of this model's."""
        return float_logits((head or self.lm_head).logits(hidden), self.cfg.final_logit_softcap)

    def greedy_logits(self, hidden: torch.Tensor, out: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """`compute_logits` into `out`'s first rows, and their argmax into `tokens`'s (a greedy
        decode graph's static buffers); returns those rows of `out`."""
        raw = self.lm_head.logits(hidden)
        n = raw.shape[0]
        ops_for(raw).logits_argmax(raw, self.cfg.final_logit_softcap, out[:n], tokens[:n])
        return out[:n]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors into this rank's parameters; every parameter must be set."""
        skip = {"lm_head.weight"} if self.cfg.tie_word_embeddings else set()
        load_weights(self, weights, self.cfg.architecture, skip=skip)


def load_weights(
    module: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    what: str,
    rename: dict[str, str] | None = None,
    skip: set[str] = frozenset(),
    stacked: tuple = STACKED_PARAMS,
) -> None:
    """Copy checkpoint tensors into `module`'s parameters (fusing `stacked` ones); every
    parameter must be set. `rename` maps checkpoint name prefixes to parameter prefixes. KV
    scales (`load_kv_scale`) go to their attention layers; FP8 weights' scales, under either
    name, to their projections (`workers/models/fp8.py`), which quantise what they are handed in
    another dtype (those not held in FP8 take no FP8 tensor)."""
    params = dict(module.named_parameters())
    modules = dict(module.named_modules())
    missing = {
        (name, shard)
        for name, param in params.items()
        if getattr(param, "required", True)
        for shard in (
            [s for fused, _, s in stacked if f".{fused}." in name and s in getattr(param, "shard_ids", (s,))] or [None]
        )
    }
    for name, tensor in weights:
        if "rotary_emb" in name or name in skip:
            continue
        for old, new in (rename or {}).items():
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        path, _, suffix = name.rpartition(".")
        if suffix in KV_SCALES:
            load_kv_scale(modules, name, tensor, what)
            continue
        if suffix in fp8.UNREAD:
            continue
        if suffix in fp8.SCALE_NAMES:
            name = f"{path}.{fp8.SCALE}"
        target, shard = name, None
        for fused, part, shard_id in stacked:
            if f".{part}." in name and name not in params:  # a layer may keep it unfused (q_proj alone)
                target, shard = name.replace(f".{part}.", f".{fused}."), shard_id
                break
        if target not in params:
            raise ValueError(f"weights: checkpoint tensor {name!r} has no parameter in {what}")
        param = params[target]
        if tensor.dtype == fp8.FP8 and param.dtype != fp8.FP8:
            raise ValueError(
                f"weights: checkpoint tensor {name!r} is FP8; {what} holds {target!r} in {param.dtype} "
                "(FP8 weights load into the decoder layers' projections)"
            )
        try:
            param.weight_loader(param, tensor if getattr(param, "quantizes", False) else tensor.to(param.dtype), shard)
        except ValueError as exc:
            raise ValueError(f"weights: checkpoint tensor {name!r} does not fit {what}: {exc}") from None
        missing.discard((target, shard))
    if missing:
        names = sorted(f"{n}[{s}]" if s is not None else n for n, s in missing)
        raise ValueError(f"weights: checkpoint lacks {names[:8]}{' ...' if len(names) > 8 else ''}")
    share_kv_scales(module)


KV_SCALES = ("k_scale", "v_scale")


def load_kv_scale(modules: dict[str, nn.Module], name: str, tensor: torch.Tensor, what: str) -> None:
    """A checkpoint's FP8 KV scale of one attention layer, as vLLM and SGLang read them
    (`<layer>.self_attn.k_scale`, `.v_scale`, or under the attention's `attn.`): one positive
    value a layer for K, one for V. A layer reading another layer's KV stores none, so its
    scales are the writer's (`share_kv_scales`), not its own tensors."""
    path, _, kind = name.rpartition(".")
    attn = modules.get(path)
    if not isinstance(attn, SelfAttention) and path.endswith(".attn"):
        attn = modules.get(path[: -len(".attn")])
    if not isinstance(attn, SelfAttention):
        raise ValueError(f"weights: checkpoint tensor {name!r} has no attention layer in {what}")
    value = float(tensor.float().reshape(-1)[0]) if tensor.numel() == 1 else None
    if value is None or not math.isfinite(value) or value <= 0:
        got = tuple(tensor.shape) if value is None else value
        raise ValueError(f"weights: checkpoint tensor {name!r}: a KV scale is one positive finite value, got {got}")
    if attn.qkv_proj is not None:
        setattr(attn.attn, kind, value)


def share_kv_scales(module: nn.Module) -> None:
    """Layers reading a KV layer of the same model (KV sharing) take its writer's scales: a KV
    layer has one layout (`workers.memory.kv_layouts`)."""
    attns = [m for m in module.modules() if isinstance(m, SelfAttention)]
    writers = {m.attn.layer_id: m.attn for m in attns if m.qkv_proj is not None}
    for m in attns:
        source = writers.get(m.attn.layer_id)
        if m.qkv_proj is None and source is not None:
            m.attn.k_scale, m.attn.v_scale = source.k_scale, source.v_scale
