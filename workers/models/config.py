"""A model's shape and attention layout, normalised from a Hugging Face `config.json`.

Architectures differ by a handful of switches (biases, q/k norms, Gemma's sandwich norms and
soft-caps); those live in the `ARCHITECTURES` table instead of in branches across the code.
Each layer's attention geometry (window, RoPE variant, head size, KV heads, the layer whose KV
it reads) is data in `LayerConfig`: Gemma 4 mixes two geometries in one model and lets its
last layers read earlier layers' KV (docs/design.md §4.6). A mixture of experts is data too
(`MoEConfig`, read by the family's `MoEStyle`): Gemma 4's and gpt-oss's differ in their router,
activation, biases and checkpoint layout, not in how they run (docs/design.md §4.8).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Literal, get_args

import torch
from transformers import AutoConfig, PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from workers.models.activations import check_activation
from workers.models.fp8 import Fp8Layout, checkpoint_layout, quantization_layout
from workers.models.geometry import global_field, kv_layers, layer_geometry
from workers.models.mxfp4 import GROUP, splits_into_groups


@dataclasses.dataclass(frozen=True)
class MoEStyle:
    """How one family's config states its mixture of experts, and the block's fixed traits."""

    experts: str  # config field: how many experts
    top_k: str  # config field: experts a token is routed to
    width: str  # config field: each expert's intermediate size
    switch: str | None = None  # config field turning the block on (Gemma 4); None: every layer has one
    activation: str | None = None  # the experts' activation; None: the config's hidden activation
    router_norm: bool = False  # Gemma 4: the router reads an RMS-normalised, scaled input and scales each expert
    bias: bool = False  # gpt-oss: the router and the experts carry biases
    layout: str = "packed"  # the checkpoint's expert tensors (`workers.models.moe.LAYOUTS`)


GEMMA4_MOE = MoEStyle(
    "num_experts", "top_k_experts", "moe_intermediate_size", switch="enable_moe_block", router_norm=True
)
GPT_OSS_MOE = MoEStyle(
    "num_local_experts",
    "num_experts_per_tok",
    "intermediate_size",
    activation="swiglu_clamped",
    bias=True,
    layout="interleaved_transposed",
)


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Each MoE layer's experts: `top_k` of `num_experts` gated MLPs `intermediate_size` wide per
    token, with the family's router and activation (`swiglu_alpha`/`swiglu_limit`: gpt-oss's
    clamped SwiGLU)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    activation: str
    router_norm: bool
    bias: bool
    layout: str
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    expert_parallel: bool = False  # ranks hold whole experts, not slices of every one (`with_moe_parallel`)
    mxfp4: bool = False  # the checkpoint stores them in MXFP4 (`workers/models/mxfp4.py`)


@dataclasses.dataclass(frozen=True)
class ArchSpec:
    """How one Hugging Face architecture differs from a plain Llama decoder."""

    qkv_bias: bool | None = None  # None: take `attention_bias` from the config
    o_bias: bool | None = None
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    gemma: bool = False  # sandwich norms, sqrt(hidden) embedding scale, soft-caps, (1 + w) norms
    one_plus_norms: bool | None = None  # RMSNorm scales by 1 + w; None: as `gemma` (Gemma 4's scale by w)
    window_on_all_layers: bool = False  # Mistral: `sliding_window` applies to every layer
    v_norm: bool = False  # values RMS-normalised (no weight) before they are stored (Gemma 4)
    attention_scale: float | None = None  # query scale whatever the head size (Gemma 4: 1; its q/k norms scale)
    model: str = "decoder"  # the module that builds it (`workers.models.loader.MODELS`)
    text_prefix: str | None = None  # multimodal checkpoints: the text model's tensors sit under `model.<prefix>.`
    sinks: bool = False  # a learned sink logit per attention head (gpt-oss)
    moe: MoEStyle | None = None  # how the config states a mixture of experts, if the family has one
    quantizations: tuple[str, ...] = ("fp8",)  # checkpoint `quantization_config.quant_method`s it loads

    @property
    def norm_one_plus(self) -> bool:
        """Whether this architecture's RMSNorms scale by 1 + w (Gemma 2 and 3) rather than w."""
        return self.gemma if self.one_plus_norms is None else self.one_plus_norms


ARCHITECTURES: dict[str, ArchSpec] = {
    "LlamaForCausalLM": ArchSpec(),
    "Qwen2ForCausalLM": ArchSpec(qkv_bias=True, o_bias=False),
    "Qwen3ForCausalLM": ArchSpec(qk_norm=True),
    "MistralForCausalLM": ArchSpec(qkv_bias=False, o_bias=False, window_on_all_layers=True),
    "Gemma2ForCausalLM": ArchSpec(gemma=True),
    "Gemma3ForCausalLM": ArchSpec(qk_norm=True, gemma=True),
}
GEMMA4 = ArchSpec(
    qk_norm=True, gemma=True, one_plus_norms=False, v_norm=True, attention_scale=1.0, model="gemma4", moe=GEMMA4_MOE
)
ARCHITECTURES["Gemma4ForCausalLM"] = GEMMA4
ARCHITECTURES["Gemma4ForConditionalGeneration"] = dataclasses.replace(GEMMA4, text_prefix="language_model")
ARCHITECTURES["GptOssForCausalLM"] = ArchSpec(sinks=True, model="gpt_oss", moe=GPT_OSS_MOE, quantizations=("mxfp4",))


@dataclasses.dataclass(frozen=True)
class LayerConfig:
    """One decoder layer's attention geometry."""

    sliding_window: int | None  # keys seen by a query, itself included; None = full attention
    rope_key: str  # which entry of ModelConfig.rope this layer uses
    head_dim: int
    num_kv_heads: int
    kv_layer: int  # the layer whose K/V this one attends: itself, or an earlier one of its type (KV sharing)
    k_eq_v: bool = False  # no V projection: V is the K projection's output before its norm and RoPE


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    inv_freq: torch.Tensor  # [rotary_dim // 2] float32
    attention_scaling: float


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    arch: ArchSpec
    hf: PretrainedConfig
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_act: str
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    scaling: float
    attn_logit_softcap: float | None
    final_logit_softcap: float | None
    max_position_embeddings: int
    layers: tuple[LayerConfig, ...]
    rope: dict[str, RopeConfig]
    eos_token_ids: tuple[int, ...]
    initializer_range: float
    # Gemma 4's per-layer embeddings: each layer's width (0: none) and the table's vocabulary
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0
    double_wide_mlp: bool = False  # layers reading another layer's KV have MLPs twice as wide (Gemma 4)
    moe: MoEConfig | None = None  # every layer's mixture of experts, or None
    quantization: str | None = None  # the checkpoint's quant_method (mxfp4: experts dequantised at load)
    fp8: Fp8Layout | None = None  # FP8 projections: the checkpoint's layout, or quantised at load (`with_quantization`)

    @property
    def layer_windows(self) -> dict[int, int | None]:
        return {i: layer.sliding_window for i, layer in enumerate(self.layers)}

    @property
    def max_window(self) -> int | None:
        windows = [w for w in self.layer_windows.values() if w is not None]
        return max(windows) if windows else None


def hidden_activation(hf: PretrainedConfig) -> str:
    """The MLP activation's name: Gemma's `hidden_activation`, else `hidden_act` (default silu),
    refused naming its field when not supported."""
    if getattr(hf, "hidden_activation", None):
        return check_activation(hf.hidden_activation, "hidden_activation")
    return check_activation(getattr(hf, "hidden_act", "silu"), "hidden_act")


def _layer_types(hf: PretrainedConfig, arch: ArchSpec) -> list[str]:
    """Every layer's attention type (`layer_types`, else one type for all)."""
    layer_types = getattr(hf, "layer_types", None)
    if layer_types is None:
        window = getattr(hf, "sliding_window", None)
        layer_types = [
            "sliding_attention" if arch.window_on_all_layers and window else "full_attention"
        ] * hf.num_hidden_layers
    unknown = set(layer_types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ValueError(f"layer_types: unsupported attention types {sorted(unknown)}")
    return list(layer_types)


def _windows(hf: PretrainedConfig, layer_types: list[str]) -> list[int | None]:
    window = getattr(hf, "sliding_window", None)
    if "sliding_attention" in layer_types and not window:
        raise ValueError("sliding_window: layer_types has sliding_attention layers but no sliding_window is set")
    return [window if t == "sliding_attention" else None for t in layer_types]


def _rope(hf: PretrainedConfig, head_dims: list[int]) -> tuple[dict[str, RopeConfig], list[str]]:
    """RoPE frequencies per layer type (each type's layers share a head size); transformers
    computes every non-default variant, from the type's own config where layers differ in
    geometry (as Gemma 4's rotary embedding does)."""
    params = getattr(hf, "rope_parameters", None) or {
        "rope_type": "default",
        "rope_theta": getattr(hf, "rope_theta", 10000.0),
    }
    layer_types = getattr(hf, "layer_types", None) or ["full_attention"] * hf.num_hidden_layers
    per_type = all(isinstance(params.get(t), dict) for t in set(layer_types))
    keys = sorted(set(layer_types)) if per_type else ["all"]
    layer_keys = list(layer_types) if per_type else ["all"] * hf.num_hidden_layers
    ropes = {}
    for key in keys:
        dims = {d for d, k in zip(head_dims, layer_keys) if k == key}
        if len(dims) != 1:
            raise ValueError(f"layer_types: the {key} layers have head sizes {sorted(dims)}; one RoPE table needs one")
        head_dim = dims.pop()
        p = params[key] if per_type else params
        rope_type = p.get("rope_type", p.get("type", "default"))
        if rope_type == "default":
            dim = int(head_dim * p.get("partial_rotary_factor", 1.0))
            inv_freq = 1.0 / (p["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
            ropes[key] = RopeConfig(inv_freq, 1.0)
        elif rope_type in ROPE_INIT_FUNCTIONS:
            source = hf.per_layer_config[key] if getattr(hf, "is_heterogeneous", False) else hf
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](
                source, torch.device("cpu"), layer_type=key if per_type else None
            )
            ropes[key] = RopeConfig(inv_freq.float(), float(scaling))
        else:
            raise ValueError(f"rope_parameters: unsupported rope_type {rope_type!r}")
    return ropes, layer_keys


def _eos_ids(configs: tuple[PretrainedConfig, ...], model_dir: str | None) -> tuple[int, ...]:
    """Token ids that end a request: config.json's (the model's and its text model's) and
    generation_config.json's `eos_token_id` (one id or a list; null entries skipped)."""
    ids: set[int] = set()
    sources = [("config.json", c) for c in configs] + [("generation_config.json", _generation_config(model_dir))]
    for name, source in sources:
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        for i in eos if isinstance(eos, (list, tuple)) else [eos]:
            if i is None:
                continue
            if not isinstance(i, int) or isinstance(i, bool) or i < 0:
                raise ValueError(f"{name}: eos_token_id must be token ids (integers >= 0), got {eos!r}")
            ids.add(i)
    return tuple(sorted(ids))


def _generation_config(model_dir: str | None) -> Any:
    path = os.path.join(model_dir, "generation_config.json") if model_dir is not None else None
    if path is None or not os.path.isfile(path):
        return None
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(model_dir)
    except Exception as exc:  # transformers' own types (OSError for bad JSON, its validators')
        raise ValueError(f"model: {path} cannot be read: {exc}") from exc


# Sizes a config must give as positive integers (field, required): anything else fails later
# as a division by zero or a negative tensor dimension.
SIZES = (
    ("vocab_size", True),
    ("hidden_size", True),
    ("intermediate_size", True),
    ("num_hidden_layers", True),
    ("num_attention_heads", True),
    ("max_position_embeddings", True),
    ("num_key_value_heads", False),
    ("head_dim", False),
)
# Config switches with values slidespec does not implement: (field, values it serves, why).
UNSUPPORTED = (("use_bidirectional_attention", (None, False, "vision"), "text tokens attend causally"),)


def _moe(hf: PretrainedConfig, arch: ArchSpec, mxfp4: bool = False) -> MoEConfig | None:
    """The experts of an architecture with a mixture of experts (when its switch is on), sizes
    checked: positive, and no more experts chosen than exist; `mxfp4`: stored in MXFP4, whose
    32-value groups must tile the matrices' rows."""
    style = arch.moe
    if style is None or (style.switch is not None and not getattr(hf, style.switch, False)):
        return None
    sizes = {}
    for field in (style.experts, style.top_k, style.width):
        value = getattr(hf, field, None)
        if type(value) is not int or value < 1:
            raise ValueError(
                f"config.json: {field} must be a positive integer for a mixture of experts, got {value!r:.40}"
            )
        sizes[field] = value
    if sizes[style.top_k] > sizes[style.experts]:
        raise ValueError(
            f"config.json: {style.top_k} {sizes[style.top_k]} exceeds {style.experts} {sizes[style.experts]}"
        )
    if mxfp4 and not splits_into_groups(hf.hidden_size, sizes[style.width]):
        raise ValueError(
            f"config.json: hidden_size {hf.hidden_size} and {style.width} {sizes[style.width]} must be multiples "
            f"of {GROUP} for MXFP4 experts (quantization_config.quant_method 'mxfp4')"
        )
    return MoEConfig(
        num_experts=sizes[style.experts],
        top_k=sizes[style.top_k],
        intermediate_size=sizes[style.width],
        activation=style.activation or hidden_activation(hf),
        router_norm=style.router_norm,
        bias=style.bias,
        layout=style.layout,
        swiglu_alpha=float(getattr(hf, "swiglu_alpha", 1.702)),
        swiglu_limit=float(getattr(hf, "swiglu_limit", 7.0)),
        mxfp4=mxfp4,
    )


def _quant_config(top: PretrainedConfig) -> dict[str, Any] | None:
    """The checkpoint's `quantization_config` as a mapping (transformers may hold an object)."""
    quant = getattr(top, "quantization_config", None)
    if quant is None or isinstance(quant, dict):
        return quant
    return quant.to_dict()


def _quantization(top: PretrainedConfig, arch: ArchSpec, name: str) -> str | None:
    """The checkpoint's `quantization_config.quant_method`, if the architecture loads it."""
    quant = _quant_config(top)
    if quant is None:
        return None
    method = quant.get("quant_method")
    method = getattr(method, "value", method)  # transformers' enum
    if method not in arch.quantizations:
        raise ValueError(
            f"config.json: quantization_config.quant_method {method!r} is not supported for {name}; "
            f"allowed: {list(arch.quantizations) or 'none (unquantised checkpoints)'}"
        )
    return method


def with_quantization(cfg: ModelConfig, quantization: str | None) -> ModelConfig:
    """`cfg` with the engine option `quantization` applied: "fp8" serves the projections in FP8,
    quantised at load from a checkpoint in another dtype (a checkpoint's own FP8 layout stays as
    it is); None: as the checkpoint."""
    if quantization is None:
        return cfg
    layout = quantization_layout(quantization)
    return cfg if cfg.fp8 is not None else dataclasses.replace(cfg, fp8=layout)


MoEParallel = Literal["tensor", "expert"]


def with_moe_parallel(cfg: ModelConfig, moe_parallel: MoEParallel) -> ModelConfig:
    """`cfg` with the engine option `moe_parallel` applied to its experts (models without a
    mixture of experts take either): "tensor" splits every expert over the tensor-parallel ranks,
    "expert" gives each rank whole experts (docs/design.md §4.8)."""
    if moe_parallel not in get_args(MoEParallel):
        raise ValueError(f"moe_parallel: 'tensor' or 'expert', got {moe_parallel!r}")
    if cfg.moe is None:
        return cfg
    return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, expert_parallel=moe_parallel == "expert"))


def model_config_from_hf(
    hf: PretrainedConfig, model_dir: str | None = None, architecture: str | None = None
) -> ModelConfig:
    """`architecture` overrides the config's own (draft heads are built from Llama layers)."""
    archs = [architecture] if architecture else (getattr(hf, "architectures", None) or [])
    known = [a for a in archs if a in ARCHITECTURES]
    if not known:
        raise ValueError(f"architectures: unsupported {archs or '(none)'}; supported: {sorted(ARCHITECTURES)}")
    name = known[0]
    arch = ARCHITECTURES[name]
    top, hf = hf, hf.get_text_config(decoder=True)  # a multimodal config's text model
    for field, required in SIZES:
        value = global_field(hf, field)
        if (required or value is not None) and (type(value) is not int or value < 1):
            raise ValueError(f"config.json: {field} must be a positive integer, got {value!r:.40}")
    for field, allowed, why in UNSUPPORTED:
        if (value := getattr(hf, field, None)) not in allowed:
            raise ValueError(f"config.json: {field} {value!r} is not supported ({why}); allowed: {list(allowed)}")
    geometry = layer_geometry(hf)
    head_dim, num_kv_heads = (global_field(hf, f) for f in ("head_dim", "num_key_value_heads"))
    head_dim = head_dim or hf.hidden_size // hf.num_attention_heads
    attention_bias = bool(getattr(hf, "attention_bias", False))
    ropes, rope_keys = _rope(hf, [d for d, _ in geometry])
    layer_types = _layer_types(hf, arch)
    windows = _windows(hf, layer_types)
    sources = kv_layers(hf, layer_types)
    k_eq_v = bool(getattr(hf, "attention_k_eq_v", False))
    query_scale = getattr(hf, "query_pre_attn_scalar", None) if arch.gemma else None
    quantization = _quantization(top, arch, name)
    per_layer = getattr(hf, "hidden_size_per_layer_input", None) or 0
    per_layer_vocab = getattr(hf, "vocab_size_per_layer_input", None) or 0
    if per_layer and per_layer_vocab < hf.vocab_size:
        raise ValueError(
            f"config.json: vocab_size_per_layer_input {per_layer_vocab} is below vocab_size {hf.vocab_size}: "
            "every token reads a row of the per-layer embeddings"
        )
    return ModelConfig(
        architecture=name,
        arch=arch,
        hf=hf,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        num_kv_heads=num_kv_heads or hf.num_attention_heads,
        head_dim=head_dim,
        hidden_act=hidden_activation(hf),
        rms_norm_eps=hf.rms_norm_eps,
        tie_word_embeddings=bool(getattr(top, "tie_word_embeddings", False)),
        qkv_bias=attention_bias if arch.qkv_bias is None else arch.qkv_bias,
        o_bias=attention_bias if arch.o_bias is None else arch.o_bias,
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        scaling=arch.attention_scale or 1.0 / math.sqrt(query_scale or head_dim),
        attn_logit_softcap=getattr(hf, "attn_logit_softcapping", None) if arch.gemma else None,
        final_logit_softcap=getattr(hf, "final_logit_softcapping", None) if arch.gemma else None,
        max_position_embeddings=hf.max_position_embeddings,
        layers=tuple(
            LayerConfig(w, key, d, kv, src, k_eq_v and w is None and src == i)
            for i, (w, key, (d, kv), src) in enumerate(zip(windows, rope_keys, geometry, sources))
        ),
        rope=ropes,
        eos_token_ids=_eos_ids((top, hf), model_dir),
        initializer_range=getattr(hf, "initializer_range", 0.02),
        per_layer_input_size=per_layer,
        per_layer_vocab_size=per_layer_vocab if per_layer else 0,
        double_wide_mlp=bool(getattr(hf, "use_double_wide_mlp", False)),
        moe=_moe(hf, arch, mxfp4=quantization == "mxfp4"),
        quantization=quantization,
        fp8=checkpoint_layout(_quant_config(top)) if quantization == "fp8" else None,
    )


def load_model_config(model: str) -> ModelConfig:
    """Read `config.json` of a local Hugging Face model directory."""
    if not os.path.isdir(model):
        raise ValueError(f"model: {model!r} is not a directory")
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise ValueError(f"model: no config.json in {model!r}")
    try:
        hf = AutoConfig.from_pretrained(model, local_files_only=True)
    except Exception as exc:  # not JSON (OSError), or transformers' own checks (their own types)
        raise ValueError(
            f"model: config.json in {model!r} is not a usable config: {type(exc).__name__}: {exc}"
        ) from exc
    return model_config_from_hf(hf, model)
