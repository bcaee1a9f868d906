"""Draft models for speculative decoding tests, written in their checkpoint layouts with random
weights: EAGLE-1 and EAGLE-3 heads, frozen-KV MTP heads, Gemma 4 assistants (built and saved with
transformers' own classes), and (perturbed) copies of a target."""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

STD = 0.08


def _config(target_dir: str) -> dict:
    return json.load(open(os.path.join(target_dir, "config.json")))


def _save(out_dir: str, config: dict, tensors: dict[str, torch.Tensor]) -> str:
    os.makedirs(out_dir, exist_ok=True)
    json.dump(config, open(os.path.join(out_dir, "config.json"), "w"), indent=1)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out_dir, "model.safetensors"))
    return out_dir


def _llama_layer(
    prefix: str,
    g: torch.Generator,
    h: int,
    heads: int,
    kv_heads: int,
    d: int,
    inter: int,
    qkv_in: int,
    norms: tuple[str, ...],
) -> dict[str, torch.Tensor]:
    def w(*shape):
        return torch.randn(*shape, generator=g) * STD

    t = {
        f"{prefix}.self_attn.q_proj.weight": w(heads * d, qkv_in),
        f"{prefix}.self_attn.k_proj.weight": w(kv_heads * d, qkv_in),
        f"{prefix}.self_attn.v_proj.weight": w(kv_heads * d, qkv_in),
        f"{prefix}.self_attn.o_proj.weight": w(h, heads * d),
        f"{prefix}.mlp.gate_proj.weight": w(inter, h),
        f"{prefix}.mlp.up_proj.weight": w(inter, h),
        f"{prefix}.mlp.down_proj.weight": w(h, inter),
    }
    for norm in norms:
        t[f"{prefix}.{norm}.weight"] = 1.0 + 0.1 * torch.randn(h, generator=g)
    return t


def make_eagle_head(
    target_dir: str,
    out_dir: str,
    version: int,
    seed: int = 0,
    draft_vocab_size: int | None = None,
    aux_layers: list[int] | None = None,
) -> str:
    """An EAGLE-1 (`LlamaForCausalLMEagle`) or EAGLE-3 (`LlamaForCausalLMEagle3`) head for a target."""
    tc = _config(target_dir)
    h, vocab = tc["hidden_size"], tc["vocab_size"]
    heads, kv_heads, d, inter = 4, 2, h // 4, 2 * h
    g = torch.Generator().manual_seed(seed)
    config = {
        "architectures": ["LlamaForCausalLMEagle" if version == 1 else "LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": inter,
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": d,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": tc["max_position_embeddings"],
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }
    if version == 1:
        tensors = {"fc.weight": torch.randn(h, 2 * h, generator=g) * STD, "fc.bias": torch.zeros(h)}
        tensors.update(_llama_layer("layers.0", g, h, heads, kv_heads, d, inter, h, ("post_attention_layernorm",)))
        return _save(out_dir, config, tensors)
    dv = draft_vocab_size or vocab
    config["draft_vocab_size"] = dv
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layers or [0, 1, tc["num_hidden_layers"] - 1]}
    tensors = {
        "fc.weight": torch.randn(h, 3 * h, generator=g) * STD,
        "norm.weight": 1.0 + 0.1 * torch.randn(h, generator=g),
        "lm_head.weight": torch.randn(dv, h, generator=g) * STD,
    }
    tensors.update(
        _llama_layer(
            "midlayer",
            g,
            h,
            heads,
            kv_heads,
            d,
            inter,
            2 * h,
            ("input_layernorm", "hidden_norm", "post_attention_layernorm"),
        )
    )
    if dv != vocab:
        target_ids = torch.randperm(vocab, generator=g)[:dv].sort().values
        tensors["d2t"] = target_ids - torch.arange(dv)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[target_ids] = True
        tensors["t2d"] = t2d
    return _save(out_dir, config, tensors)


def make_frozen_kv_head(target_dir: str, out_dir: str, seed: int = 0, kv_source_layers: list[int] | None = None) -> str:
    """A frozen-KV MTP head whose layers read the given (default: last SWA, last full) target layers."""
    tc = _config(target_dir)
    h, heads = tc["hidden_size"], tc["num_attention_heads"]
    d = tc.get("head_dim") or h // heads
    inter = 2 * h
    gemma = "gemma" in tc.get("model_type", "")
    layer_types = tc.get("layer_types") or ["full_attention"] * tc["num_hidden_layers"]
    if kv_source_layers is None:
        last = {t: i for i, t in enumerate(layer_types)}
        kv_source_layers = sorted(last.values())
    g = torch.Generator().manual_seed(seed)
    config = {
        **tc,
        "architectures": ["FrozenKVMTPForCausalLM"],
        "kv_source_layers": kv_source_layers,
        "intermediate_size": inter,
    }

    def w(*shape):
        return torch.randn(*shape, generator=g) * STD

    def norm():
        return 0.1 * torch.randn(h, generator=g) if gemma else 1.0 + 0.1 * torch.randn(h, generator=g)

    tensors = {
        "fc.weight": w(h, 2 * h),
        "pre_fc_norm_embedding.weight": norm(),
        "pre_fc_norm_hidden.weight": norm(),
        "norm.weight": norm(),
    }
    norms = ["input_layernorm", "post_attention_layernorm"]
    if gemma:
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    for i, _ in enumerate(kv_source_layers):
        p = f"layers.{i}"
        tensors.update(
            {
                f"{p}.self_attn.q_proj.weight": w(heads * d, h),
                f"{p}.self_attn.o_proj.weight": w(h, heads * d),
                f"{p}.mlp.gate_proj.weight": w(inter, h),
                f"{p}.mlp.up_proj.weight": w(inter, h),
                f"{p}.mlp.down_proj.weight": w(h, inter),
            }
        )
        if tc.get("model_type") in ("gemma3_text", "qwen3"):
            tensors[f"{p}.self_attn.q_norm.weight"] = 0.1 * torch.randn(d, generator=g)
        for n in norms:
            tensors[f"{p}.{n}.weight"] = norm()
    return _save(out_dir, config, tensors)


def make_gemma4_assistant(
    target_dir: str,
    out_dir: str,
    ordered: bool = True,
    seed: int = 0,
    centroids: int = 16,
    top_k: int = 4,
    copies: float = 0.0,
) -> str:
    """A `Gemma4AssistantForCausalLM` for a Gemma 4 target (transformers' classes, random weights,
    norms and layer scalars perturbed off identity): three layers of its own width (sliding,
    sliding, full) whose head shapes are the target's, and with `ordered` a centroid head of
    `centroids` centroids, `top_k` of them active, over a random token ordering.

    `copies` > 0 adds a path that proposes the input token again, that many times stronger than
    the embedding's random projection: its layers still read the target's KV, and on a target
    that repeats tokens (random tiny ones do) some drafts are accepted, some not."""
    import transformers

    target = transformers.AutoConfig.from_pretrained(target_dir)
    tc = target.to_dict()
    full = next(i for i, t in enumerate(target.layer_types) if t == "full_attention")
    text = transformers.Gemma4TextConfig(
        vocab_size=target.vocab_size,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        head_dim=tc["head_dim"],
        num_key_value_heads=tc["num_key_value_heads"],
        global_head_dim=tc["per_layer_config"][str(full)]["head_dim"],
        num_global_key_value_heads=tc["per_layer_config"][str(full)]["num_key_value_heads"],
        attention_k_eq_v=True,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        sliding_window=target.sliding_window,
        max_position_embeddings=target.max_position_embeddings,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        final_logit_softcapping=30.0,  # transformers' assistant does not soft-cap: neither may slidespec
        initializer_range=0.08,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    config = transformers.Gemma4AssistantConfig(
        text_config=text,
        backbone_hidden_size=target.hidden_size,
        use_ordered_embeddings=ordered,
        num_centroids=centroids,
        centroid_intermediate_top_k=top_k,
    )
    config.architectures = ["Gemma4AssistantForCausalLM"]
    torch.manual_seed(seed)
    model = transformers.Gemma4AssistantForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.add_(torch.randn_like(b) * 0.1)
        if ordered:
            model.masked_embedding.token_ordering.copy_(torch.randperm(target.vocab_size))
        if copies:
            _copy_path(model, transformers.AutoModelForCausalLM.from_pretrained(target_dir), copies)
    model.save_pretrained(out_dir)
    return out_dir


def _copy_path(model, target, strength: float) -> None:
    """Make `model` (an assistant) favour its input token: the embedding half of its input
    projection becomes `strength` x a random map A, and the LM-head row of token t the unit
    vector along A e_t (each centroid the sum of its tokens' rows), so that the normed state of
    input t scores t highest unless its layers outweigh the path."""
    embed = target.get_input_embeddings().weight.detach()
    h, b = model.pre_projection.weight.shape[0], embed.shape[1]
    a = torch.randn(h, b) / b**0.5
    rows = torch.nn.functional.normalize(embed @ a.T, dim=-1)
    model.pre_projection.weight[:, :b] = strength * a
    model.lm_head.weight.copy_(rows)  # tied to the embedding table the checkpoint stores
    if model.masked_embedding is not None:
        members = model.masked_embedding.token_ordering.view(model.config.num_centroids, -1)
        model.masked_embedding.centroids.weight.copy_(rows[members].sum(dim=1))


def make_perturbed_copy(target_dir: str, out_dir: str, noise: float, seed: int = 0) -> str:
    """A standalone draft: the target's weights plus Gaussian noise of relative size `noise`
    (0 gives an exact copy, whose drafts the target always accepts)."""
    shutil.copytree(target_dir, out_dir, dirs_exist_ok=True)
    path = os.path.join(out_dir, "model.safetensors")
    g = torch.Generator().manual_seed(seed)
    weights = load_file(path)
    for name, t in weights.items():
        if noise and t.is_floating_point():
            scale = t.std() if t.numel() > 1 else t.abs()  # a lone scalar (Gemma 4's layer_scalar) has no spread
            weights[name] = t + noise * scale * torch.randn(t.shape, generator=g)
    save_file(weights, path)
    return out_dir


def make_target_and_draft(root, noise: float = 0.0) -> tuple[str, str]:
    """A tiny Gemma 3 target in root/gemma3 and a perturbed copy of it as standalone draft."""
    from tests.hf_models import make_tiny_model

    target = str(root / "gemma3")
    make_tiny_model("gemma3", target)
    return target, make_perturbed_copy(target, str(root / "draft"), noise=noise)


# draft variant -> (algorithm, draft pool kind, key of the draft in `spec_models`)
SPEC_VARIANTS = {
    "standalone-swa": ("standalone", "swa", "swa_draft"),
    "standalone-full": ("standalone", "full", "copy"),
    "eagle1-full": ("eagle", "full", "eagle1"),
    "eagle3-full": ("eagle", "full", "eagle3"),
    "frozen_kv_mtp-target": ("frozen_kv_mtp", "target", "frozen"),
}


def spec_models(root) -> dict[str, dict[str, str]]:
    """Per target (gemma3, llama): the target, a perturbed copy (partial acceptance), an exact
    copy, a draft with sliding-window layers for the SWA draft pool, EAGLE-1/3 heads and a
    frozen-KV head, written under `root`."""
    from tests.hf_models import make_tiny_model

    out = {}
    for name in ("gemma3", "llama"):
        target = str(root / name)
        make_tiny_model(name, target)
        copy = make_perturbed_copy(target, str(root / f"{name}_copy"), noise=0.1)
        if name == "gemma3":
            swa_draft = copy
        else:  # a full-attention target with a hybrid draft: the allocator keeps SWA slots for the draft
            swa_draft = str(root / "llama_swa_draft")
            make_tiny_model("gemma3", swa_draft, seed=3)
        out[name] = {
            "target": target,
            "copy": copy,
            "swa_draft": swa_draft,
            "exact_copy": make_perturbed_copy(target, str(root / f"{name}_exact"), noise=0.0),
            "eagle1": make_eagle_head(target, str(root / f"{name}_eagle1"), 1),
            "eagle3": make_eagle_head(target, str(root / f"{name}_eagle3"), 3, draft_vocab_size=200),
            "frozen": make_frozen_kv_head(target, str(root / f"{name}_frozen")),
        }
    return out
