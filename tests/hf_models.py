"""Tiny random Hugging Face models, built with transformers' own config classes and saved with
`save_pretrained`: the independent reference every model test compares against."""

from __future__ import annotations

import os

import torch
import transformers

WINDOW = 8
COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
    initializer_range=0.08,
)

# name -> (config class, model class, config overrides)
TINY_MODELS = {
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            num_hidden_layers=2,
            head_dim=16,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_hidden_layers=2)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_hidden_layers=2, head_dim=32)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_hidden_layers=2, head_dim=16, sliding_window=WINDOW)),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            num_hidden_layers=4,
            head_dim=16,
            sliding_window=WINDOW,
            query_pre_attn_scalar=16,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            layer_types=["sliding_attention", "full_attention"] * 2,
        ),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            num_hidden_layers=3,
            head_dim=16,
            sliding_window=WINDOW,
            query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
            },
        ),
    ),
    # Two geometries (sliding: 2 KV heads of 16; full: 1 of 32, V from the K projection),
    # per-layer embeddings, the last two layers reading layers 2 and 3's KV with double-wide MLPs,
    # proportional RoPE on a quarter of the full layers' dimensions.
    "gemma4": (
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        dict(
            num_hidden_layers=6,
            head_dim=16,
            global_head_dim=32,
            num_global_key_value_heads=1,
            attention_k_eq_v=True,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
            num_kv_shared_layers=2,
            use_double_wide_mlp=True,
            hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=256,
            final_logit_softcapping=30.0,
        ),
    ),
    # Gemma 4's mixture of experts beside every layer's MLP (as in 26B-A4B) on the model above:
    # 8 experts, 2 a token.
    "gemma4_moe": (
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        dict(
            num_hidden_layers=6,
            head_dim=16,
            global_head_dim=32,
            num_global_key_value_heads=1,
            attention_k_eq_v=True,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
            num_kv_shared_layers=2,
            use_double_wide_mlp=True,
            hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=256,
            final_logit_softcapping=30.0,
            enable_moe_block=True,
            num_experts=8,
            top_k_experts=2,
            moe_intermediate_size=32,
        ),
    ),
    # gpt-oss: sliding and full layers alternating, sinks, biases, YaRN, 8 experts (2 a token)
    # whose SwiGLU clamp (0.5) the activations reach.
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            num_hidden_layers=4,
            head_dim=16,
            intermediate_size=32,
            sliding_window=WINDOW,
            num_local_experts=8,
            num_experts_per_tok=2,
            swiglu_limit=0.5,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 8.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 128,
            },
        ),
    ),
}

# Parameters transformers initialises at zero or one, perturbed so that they are tested too:
# model -> (parameter-name ending, noise std).
PERTURB = {
    "gemma4_moe": (("router.scale", 0.3), ("per_expert_scale", 0.3)),
    "gpt_oss": (("sinks", 1.0), ("bias", 0.02), ("router.weight", 0.3)),
}


def make_tiny_model(name: str, out_dir: str, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """Build, randomly initialise, save and return a tiny HF model (float32, eager attention)."""
    config_cls, model_cls, kwargs = TINY_MODELS[name]
    config = getattr(transformers, config_cls)(**{**COMMON, **kwargs, **overrides})
    config.architectures = [model_cls]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # norms and layer scalars start at identity in HF; perturb them so they are tested too
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.add_(torch.randn_like(p) * 0.1)
        for pname, b in model.named_buffers():
            if pname.endswith("layer_scalar"):
                b.add_(torch.randn_like(b) * 0.1)
        for pname, p in model.named_parameters():
            for ending, std in PERTURB.get(name, ()):
                if pname.endswith(ending):
                    p.add_(torch.randn_like(p) * std)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    model.config._attn_implementation = "eager"
    return model


def random_prompts(lengths: list[int], vocab: int = 256, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def add_tokenizer(path: str, vocab_size: int = 256) -> None:
    """Train a tiny byte-level BPE tokenizer and save it into a model directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<eos>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>").save_pretrained(path)
