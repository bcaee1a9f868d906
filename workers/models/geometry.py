"""Each layer's attention geometry, read from a Hugging Face config (docs/design.md §4.6).

Most models give every layer the same head size and KV heads. Gemma 4's full-attention layers
have their own (`global_head_dim`, `num_global_key_value_heads` in its checkpoints'
config.json), which transformers' config class turns into per-layer overrides: its
`per_layer_config`, as `save_pretrained` writes it, keyed by layer index. Reading those fields
off the config object raises (they are ambiguous model-wide), so they are read here from the
config's dictionary, config.json's form, and nowhere else.

KV sharing (`num_kv_shared_layers`): the last N layers store no K/V and attend that of the
last earlier layer of their attention type.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

PER_LAYER_FIELDS = ("head_dim", "num_key_value_heads")


def global_field(hf: PretrainedConfig, name: str) -> Any:
    """A config field's model-wide value (None when absent). A heterogeneous config refuses a
    plain read of its per-layer fields; their model-wide value is config.json's."""
    if name in (getattr(hf, "per_layer_attributes", None) or ()):
        return hf.to_dict().get(name)
    return getattr(hf, name, None)


def layer_geometry(hf: PretrainedConfig) -> list[tuple[int, int]]:
    """(head size, KV heads) of every layer: the config's, overridden by `per_layer_config`."""
    heads = hf.num_attention_heads
    head_dim = global_field(hf, "head_dim") or hf.hidden_size // heads
    kv_heads = global_field(hf, "num_key_value_heads") or heads
    n = hf.num_hidden_layers
    geometry = [(head_dim, kv_heads)] * n
    overrides = (hf.to_dict().get("per_layer_config") or {}) if getattr(hf, "is_heterogeneous", False) else {}
    for key, fields in overrides.items():
        layer = int(key) if str(key).isdigit() else -1
        if not 0 <= layer < n:
            raise ValueError(f"per_layer_config: key {key!r} is not a layer index (0..{n - 1})")
        unknown = sorted(set(fields) - set(PER_LAYER_FIELDS))
        if unknown:
            raise ValueError(
                f"per_layer_config: layer {layer} overrides {unknown}; supported: {list(PER_LAYER_FIELDS)}"
            )
        for field, value in fields.items():
            if type(value) is not int or value < 1:
                raise ValueError(f"per_layer_config: layer {layer} {field} must be a positive integer, got {value!r}")
        geometry[layer] = (fields.get("head_dim", head_dim), fields.get("num_key_value_heads", kv_heads))
    return geometry


def kv_layers(hf: PretrainedConfig, layer_types: list[str]) -> list[int]:
    """The layer whose K/V each layer attends: itself, or for the last `num_kv_shared_layers`
    layers the last earlier layer of the same attention type that stores its own."""
    n = len(layer_types)
    shared = getattr(hf, "num_kv_shared_layers", 0) or 0
    if type(shared) is not int or not 0 <= shared < n:
        raise ValueError(f"num_kv_shared_layers: must be an integer in [0, {n}) (some layer stores KV), got {shared!r}")
    first = n - shared
    sources = list(range(first))
    for i in range(first, n):
        producers = [j for j in range(first) if layer_types[j] == layer_types[i]]
        if not producers:
            raise ValueError(
                f"num_kv_shared_layers: layer {i} ({layer_types[i]}) reads shared KV, but no layer before "
                f"layer {first} of that type stores any"
            )
        sources.append(producers[-1])
    return sources
