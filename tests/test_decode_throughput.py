"""The decode benchmark's roofline counts the bytes a step reads: on a tiny Gemma 4 (per-layer
embeddings, KV-shared layers, full layers of another head size), every weight but the per-layer
table and the token embedding, which a token reads one row of, unless the embedding is also the
LM head; and the KV of the layers that store it. Both counted here from config.json alone."""

import json

import pytest
import torch

from ops.bench.decode_throughput import SHAPES, kv_bytes_per_token, weight_bytes
from workers.engine import Engine, SamplingParams

FLOAT32 = 4
CONFIG = dict(
    architectures=["Gemma4ForCausalLM"],
    model_type="gemma4_text",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    sliding_window=8,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
    num_kv_shared_layers=2,
    hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=512,
    max_position_embeddings=1024,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def step_parameters(c: dict) -> int:
    """Parameters a decode step reads whole, from the config: each layer's query and output
    projections and q-norm, K/V projections and k-norm where it stores KV, MLP, four norms,
    per-layer-input gate, projection and norm, and scalar; the per-layer-input projection of the
    embedding and its norm, the final norm; the LM head (the tied embedding table)."""
    h, n, width = c["hidden_size"], c["num_hidden_layers"], c["hidden_size_per_layer_input"]
    total = 0
    for i, kind in enumerate(c["layer_types"]):
        d = c["global_head_dim"] if kind == "full_attention" else c["head_dim"]
        q = c["num_attention_heads"] * d
        total += 2 * h * q + d + 3 * h * c["intermediate_size"] + 4 * h + 2 * h * width + h + 1
        if i < n - c["num_kv_shared_layers"]:
            total += 2 * h * c["num_key_value_heads"] * d + d
    return total + h * n * width + width + h + c["vocab_size"] * h


def kv_bytes(c: dict) -> int:
    """K and V of one token over the layers that store KV, float32."""
    stored = c["layer_types"][: c["num_hidden_layers"] - c["num_kv_shared_layers"]]
    dims = [c["global_head_dim"] if kind == "full_attention" else c["head_dim"] for kind in stored]
    return sum(2 * c["num_key_value_heads"] * d * FLOAT32 for d in dims)


@pytest.mark.parametrize("tied", [True, False])
def test_roofline_bytes_leave_out_the_tables_a_token_reads_a_row_of(tmp_path, tied):
    config = {**CONFIG, "tie_word_embeddings": tied}
    (tmp_path / "config.json").write_text(json.dumps(config))
    engine = Engine(model=str(tmp_path), load_format="dummy", dtype="float32", max_total_tokens=256)
    every = sum(p.numel() for p in engine.runner.model.parameters()) * FLOAT32
    per_layer_table = config["vocab_size_per_layer_input"] * config["num_hidden_layers"] * 8 * FLOAT32
    embedding = 0 if tied else config["vocab_size"] * config["hidden_size"] * FLOAT32
    assert weight_bytes(engine) == step_parameters(config) * FLOAT32 == every - per_layer_table - embedding
    assert kv_bytes_per_token(engine) == kv_bytes(config)


@pytest.mark.parametrize(
    "shape, kv_layers, full", [("gemma4-e4b", 24, (512, 2, False, 23)), ("gemma4-31b", 60, (512, 4, True, 59))]
)
def test_gemma4_shapes_have_the_published_geometry(tmp_path, shape, kv_layers, full):
    """The real shapes read as the published models are built: 256-wide sliding heads, the
    last full layer's head size, KV heads, V from K and the layer whose KV it reads, and how
    many layers store KV (E4B: the last 18 of 42 read layers 22 and 23's)."""
    from ops.bench.decode_throughput import write_config
    from workers.models import load_model_config

    cfg = load_model_config(write_config(str(tmp_path), shape, SHAPES[shape]))
    last = cfg.layers[-1]
    assert (last.head_dim, last.num_kv_heads, last.k_eq_v, last.kv_layer) == full
    assert cfg.layers[0].head_dim == 256 and sum(layer.kv_layer == i for i, layer in enumerate(cfg.layers)) == kv_layers


def test_the_31b_assistant_shape_drafts_for_the_31b_shape(tmp_path):
    """The spec part's assistant passes the checks a draft meets at start-up against the 31B
    shape: its layers read the target's last sliding and full KV layers in their geometry."""
    from ops.bench.decode_throughput import GEMMA4_31B_ASSISTANT, write_config
    from workers.models import load_model_config
    from workers.models.gemma4_assistant import assistant_config

    target = load_model_config(write_config(str(tmp_path), "t", SHAPES["gemma4-31b"]))
    ac = assistant_config(write_config(str(tmp_path), "a", GEMMA4_31B_ASSISTANT), target)
    assert [layer.kv_layer for layer in ac.cfg.layers] == [58, 58, 58, 59] and ac.num_centroids == 0


def test_the_moe_shapes_drafts_pass_their_start_up_checks(tmp_path):
    """The spec part's drafts for the MoE shapes: gpt-oss-20b's EAGLE-3 head reads three of its
    layers with a 32K draft vocabulary; the 26B-A4B assistant's layers read the target's last
    sliding and full KV layers in their geometry."""
    from ops.bench.decode_throughput import GEMMA4_26B_A4B_ASSISTANT, GPT_OSS_20B_EAGLE3, write_config
    from workers.models import load_model_config
    from workers.models.eagle import load_eagle_config
    from workers.models.gemma4_assistant import assistant_config

    target = load_model_config(write_config(str(tmp_path), "oss", SHAPES["gpt-oss-20b"]))
    ec = load_eagle_config(write_config(str(tmp_path), "e3", GPT_OSS_20B_EAGLE3), target, "dummy")
    assert (ec.version, ec.draft_vocab_size, len(ec.aux_layer_ids)) == (3, 32000, 3)
    target = load_model_config(write_config(str(tmp_path), "moe", SHAPES["gemma4-26b-a4b"]))
    ac = assistant_config(write_config(str(tmp_path), "a", GEMMA4_26B_A4B_ASSISTANT), target)
    assert [layer.kv_layer for layer in ac.cfg.layers] == [28, 28, 28, 29]


def test_roofline_counts_the_share_of_experts_a_batch_chooses(tmp_path):
    """A mixture of experts' experts count as the share a batch's tokens choose at uniform
    routing (1 - (1 - k/E)^batch); everything else as for a dense model."""
    from tests.hf_models import COMMON, TINY_MODELS

    _, model_cls, kwargs = TINY_MODELS["gpt_oss"]
    config = {**COMMON, **kwargs, "architectures": [model_cls], "model_type": "gpt_oss"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    engine = Engine(model=str(tmp_path), load_format="dummy", dtype="float32", max_total_tokens=256)
    experts, top_k, width, h = 8, 2, config["intermediate_size"], config["hidden_size"]
    per_layer_experts = experts * (2 * width * h + 2 * width + width * h + h)
    dense = sum(p.numel() for p in engine.runner.model.parameters()) - config["num_hidden_layers"] * per_layer_experts
    embedding = config["vocab_size"] * h  # untied: a token reads one row
    for batch in (1, 8, 64):
        share = 1 - (1 - top_k / experts) ** batch
        expected = (dense - embedding + config["num_hidden_layers"] * per_layer_experts * share) * FLOAT32
        assert abs(weight_bytes(engine, batch) - expected) <= 1, batch


def test_roofline_counts_mxfp4_experts_as_stored(tmp_path):
    """The `mxfp4` variant: gpt-oss's experts half a byte a weight and a byte a 32-weight group's
    scale (their biases and the rest in the model's dtype), held as stored; the dummy codes decode
    to weights of about the configured spread, and a greedy decode of them stays finite."""
    from ops.bench.decode_throughput import VARIANTS
    from tests.hf_models import COMMON, TINY_MODELS

    _, model_cls, kwargs = TINY_MODELS["gpt_oss"]
    config = {**COMMON, **kwargs, "architectures": [model_cls], "model_type": "gpt_oss", **VARIANTS["mxfp4"][1]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    engine = Engine(model=str(tmp_path), load_format="dummy", dtype="float32", max_total_tokens=256)
    experts, top_k, width, h, layers = 8, 2, config["intermediate_size"], config["hidden_size"], 4
    matrices = experts * 3 * width * h * 17 // 32  # blocks and scales
    biases = experts * (2 * width + h) * FLOAT32
    model = engine.runner.model
    everything = sum(p.numel() * p.element_size() for p in model.parameters())
    dense = everything - layers * (matrices + biases) - config["vocab_size"] * h * FLOAT32
    for batch in (1, 8):
        share = 1 - (1 - top_k / experts) ** batch
        assert abs(weight_bytes(engine, batch) - (dense + layers * (matrices + biases) * share)) <= 1, batch
    gate_up, down = model.model.layers[0].mlp.experts.matrices()
    spread = torch.stack([gate_up.expert(e) for e in range(experts)]).pow(2).mean().sqrt().item()
    assert config["initializer_range"] / 2 <= spread <= config["initializer_range"] * 2, spread
    out = engine.generate(prompt_token_ids=[[1, 2, 3]], sampling=SamplingParams(max_new_tokens=4, temperature=0.0))
    assert len(out[0].token_ids) == 4


@pytest.mark.parametrize("shape, experts, top_k", [("gemma4-26b-a4b", 128, 8), ("gpt-oss-20b", 32, 4)])
def test_moe_shapes_have_the_published_experts(tmp_path, shape, experts, top_k):
    from ops.bench.decode_throughput import write_config
    from workers.models import load_model_config

    cfg = load_model_config(write_config(str(tmp_path), shape, SHAPES[shape]))
    assert (cfg.moe.num_experts, cfg.moe.top_k) == (experts, top_k)
    windows = {layer.sliding_window for layer in cfg.layers}
    assert windows == ({1024, None} if shape.startswith("gemma4") else {128, None})


@pytest.mark.parametrize("variant", ["bf16", "fp8", "fp8-block", "kv8", "fp8+kv8"])
def test_variants_count_the_bytes_as_stored(tmp_path, variant):
    """FP8 projections read a byte a weight and four a scale (a scale a row, or a 128 x 128
    block); an FP8 KV entry a byte; the rest (norms, the LM head) as the model's dtype. Counted
    from the config's sizes."""
    from ops.bench.decode_throughput import VARIANTS, case_name

    h, inter, heads, kv_heads, d, layers, vocab = 256, 512, 2, 1, 128, 2, 512
    config = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=h,
        intermediate_size=inter,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=d,
        num_hidden_layers=layers,
        vocab_size=vocab,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
    )
    options, fields = VARIANTS[variant]
    (tmp_path / "config.json").write_text(json.dumps({**config, **fields}))
    engine = Engine(model=str(tmp_path), load_format="dummy", dtype="float32", max_total_tokens=256, **options)
    shapes = [((heads + 2 * kv_heads) * d, h), (h, heads * d), (2 * inter, h), (h, inter)]  # qkv, o, gate/up, down
    weights = layers * sum(n * k for n, k in shapes)
    fp8 = "quantization" in options or "quantization_config" in fields
    scales = {"fp8-block": sum((n // 128) * (k // 128) for n, k in shapes)}.get(variant, sum(n for n, _ in shapes))
    rest = layers * 2 * h + h + vocab * h  # norms, the final norm, the LM head
    expected = (weights + layers * scales * FLOAT32 + rest * FLOAT32) if fp8 else (weights + rest) * FLOAT32
    assert weight_bytes(engine) == expected
    kv_entry = 1 if options.get("kv_cache_dtype") == "fp8_e4m3" else FLOAT32
    assert kv_bytes_per_token(engine) == layers * 2 * kv_heads * d * kv_entry
    assert (
        case_name("llama3-8b", variant, 4096)
        == ("llama3-8b" if variant == "bf16" else f"llama3-8b+{variant}") + "@4096"
    )
