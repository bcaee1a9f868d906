"""Mixtures of experts against Hugging Face transformers, float32 on CPU.

Two tiny random models (`tests/hf_models.py`): Gemma 4 with its MoE block beside every layer's
MLP (26B-A4B's layer, on the tiny Gemma 4 with both geometries, KV sharing and per-layer
embeddings; router scales perturbed off one), and gpt-oss (sliding and full layers alternating,
random non-zero sinks, attention and expert biases, YaRN, experts whose SwiGLU clamp the
activations reach). Greedy tokens equal `generate`'s and every generated token's logits are within
float32 noise of the full forward's, on both attention backends (the CPU reference kernels behind
trtllm_mha), page sizes 16 and 64, prompts past the window; every expert of every layer is chosen
by some token; no KV leaks. gpt-oss loads from an MXFP4 checkpoint made by quantising it in
OpenAI's format (transformers' own dequantisation of the file is the reference). Drafted under
emulated graphs (a perturbed copy or an EAGLE-3 head for gpt-oss, its assistant for Gemma 4
MoE), the tokens stay transformers'. The routing never reads the device back: the block runs on
fake tensors, whose values no one can read.
"""

import json
import os

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from torch._subclasses.fake_tensor import FakeTensorMode

from tests.draft_models import make_eagle_head, make_gemma4_assistant, make_perturbed_copy
from tests.hf_models import COMMON, TINY_MODELS, WINDOW, make_tiny_model, random_prompts
from workers.distributed import SINGLE_RANK
from workers.engine import Engine, SamplingParams
from workers.models.config import model_config_from_hf, with_moe_parallel
from workers.models.moe import Experts, Router, SparseMoE
from workers.models.mxfp4 import FP4_VALUES, SCALE_BIAS

NEW_TOKENS = 16
PROMPTS = random_prompts([40, WINDOW + 3, 2 * WINDOW + 1], seed=3)
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, return_logits=True)
MODELS = ["gemma4_moe", "gpt_oss"]


def hf_reference(model: transformers.PreTrainedModel, prompts: list[list[int]]) -> list[tuple[list[int], torch.Tensor]]:
    """(greedy continuation, logits of every generated token) of each prompt, the experts run by
    transformers' plain loop over them."""
    model.set_experts_implementation("eager")
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
            logits = model(gen[:, :-1]).logits[0].float()[len(prompt) - 1 :]
            out.append((gen[0, len(prompt) :].tolist(), logits))
    return out


@pytest.fixture(scope="module", params=MODELS)
def reference(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    return request.param, path, hf_reference(make_tiny_model(request.param, path), PROMPTS)


def assert_matches(outs, expected, what: str) -> None:
    for i, (out, (tokens, logits)) in enumerate(zip(outs, expected)):
        diff = (torch.stack(out.logits) - logits).abs().max().item()
        assert diff <= 1e-4, f"{what} prompt {i}: max |logit diff| {diff:.2e}"
        assert out.token_ids == tokens, f"{what} prompt {i}: greedy tokens differ from transformers"


def record_routes(model: torch.nn.Module) -> dict[str, set[int]]:
    """Every expert each router chooses from now on, by router."""
    chosen: dict[str, set[int]] = {}
    for name, module in model.named_modules():
        if isinstance(module, Router):
            seen = chosen.setdefault(name, set())
            module.register_forward_hook(lambda m, args, out, seen=seen: seen.update(out[1].flatten().tolist()))
    return chosen


@pytest.mark.parametrize("backend", ["torch_native", "trtllm_mha"])
@pytest.mark.parametrize("page_size", [16, 64])
def test_matches_transformers(reference, backend, page_size):
    name, path, expected = reference
    eng = Engine(
        model=path,
        dtype="float32",
        page_size=page_size,
        attention_backend=backend,
        max_total_tokens=4096,
        chunked_prefill_size=16,
    )
    chosen = record_routes(eng.runner.model)
    assert_matches(eng.generate(prompt_token_ids=PROMPTS, sampling=GREEDY), expected, f"{name} {backend} {page_size}")
    experts = eng.cfg.moe.num_experts
    assert len(chosen) == eng.cfg.num_layers
    assert all(seen == set(range(experts)) for seen in chosen.values()), {k: sorted(v) for k, v in chosen.items()}
    eng.check_no_leak()


@pytest.mark.parametrize("reference", ["gemma4_moe"], indirect=True)
def test_gemma4_assistant_drafts_for_the_moe_target(reference, tmp_path):
    """Gemma 4's assistant (query-only layers reading the MoE target's KV) drafting for it under
    emulated graphs: transformers' tokens, and some drafts accepted."""
    name, path, expected = reference
    assistant = make_gemma4_assistant(path, str(tmp_path / "assistant"), copies=10.0)
    eng = Engine(
        model=path,
        dtype="float32",
        page_size=16,
        attention_backend="trtllm_mha",
        max_total_tokens=4096,
        speculative={"algorithm": "mtp", "draft_model": assistant, "num_steps": 3},
        cuda_graphs="emulate",
        max_running_requests=4,
    )
    outs = eng.generate(prompt_token_ids=PROMPTS, sampling=GREEDY)
    assert_matches(outs, expected, f"{name} drafted by its assistant")
    assert max(n for o in outs for n in o.spec.accept_lengths) > 1
    eng.check_no_leak()


@pytest.mark.parametrize("reference", ["gpt_oss"], indirect=True)
@pytest.mark.parametrize("draft", ["standalone", "eagle3"])
def test_drafts_keep_transformers_tokens_under_emulated_graphs(reference, tmp_path, draft):
    """A perturbed copy, or an EAGLE-3 head reading three of its layers, drafting for gpt-oss:
    every verify forward routes its tokens (several a request) independently, and the tokens stay
    transformers'."""
    name, path, expected = reference
    if draft == "eagle3":
        spec = {"algorithm": "eagle", "draft_model": make_eagle_head(path, str(tmp_path / "eagle"), 3)}
    else:
        spec = {"algorithm": "standalone", "draft_model": make_perturbed_copy(path, str(tmp_path / "copy"), noise=0.05)}
    eng = Engine(
        model=path,
        dtype="float32",
        page_size=16,
        attention_backend="trtllm_mha",
        max_total_tokens=4096,
        speculative={**spec, "num_steps": 3},
        cuda_graphs="emulate",
        max_running_requests=4,
    )
    outs = eng.generate(prompt_token_ids=PROMPTS, sampling=GREEDY)
    assert_matches(outs, expected, f"{name} drafted by {draft}")
    lengths = [n for o in outs for n in o.spec.accept_lengths]
    assert draft == "eagle3" or sum(lengths) / len(lengths) > 1.2, lengths
    eng.check_no_leak()


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """OpenAI's MXFP4 of a `[..., rows, cols]` matrix: per 32 values of a row an E8M0 scale (the
    power of two that brings the largest magnitude to at most 6, biased by 127) and E2M1 codes
    rounded to the nearest value, two a byte with the even column in the low nibble:
    (blocks `[..., rows, cols / 32, 16]`, scales `[..., rows, cols / 32]`)."""
    groups = weight.float().unflatten(-1, (-1, 32))
    amax = groups.abs().amax(-1, keepdim=True).clamp(min=2.0**-126)
    exp = torch.ceil(torch.log2(amax / 6.0))
    magnitudes = torch.tensor(FP4_VALUES[:8], device=weight.device)
    scaled = groups / torch.exp2(exp)
    code = (scaled.abs()[..., None] - magnitudes).abs().argmin(-1) + 8 * (scaled < 0)
    pairs = code.to(torch.uint8).unflatten(-1, (16, 2))
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    return blocks, (exp[..., 0] + SCALE_BIAS).to(torch.uint8)


def quantize_checkpoint_mxfp4(path: str) -> None:
    """Rewrite the gpt-oss checkpoint in `path` with its experts in MXFP4 (`*_blocks`, `*_scales`,
    the config's quantization_config), as OpenAI ships them."""
    weights = load_file(os.path.join(path, "model.safetensors"))
    for name in [n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(weights.pop(name).transpose(1, 2))  # stored [E, in, out]: rows are outputs
        weights[f"{name}_blocks"], weights[f"{name}_scales"] = blocks, scales
    save_file(weights, os.path.join(path, "model.safetensors"))
    config = json.load(open(os.path.join(path, "config.json")))
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    json.dump(config, open(os.path.join(path, "config.json"), "w"))


def test_mxfp4_checkpoint_gives_the_dequantised_models_tokens(tmp_path):
    """A random gpt-oss with its experts quantised to MXFP4 loads, its experts kept in 4 bits, and
    gives the tokens and logits of transformers' model dequantising the same file; transformers'
    weights are the originals within FP4's error, so the file is in its format."""
    path = str(tmp_path / "gpt_oss")
    original = make_tiny_model("gpt_oss", path)
    quantize_checkpoint_mxfp4(path)
    hf = transformers.GptOssForCausalLM.from_pretrained(
        path, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32
    ).eval()
    hf.config._attn_implementation = "eager"
    for layer, ref in zip(hf.model.layers, original.model.layers):
        for part in ("gate_up_proj", "down_proj"):
            got, want = getattr(layer.mlp.experts, part), getattr(ref.mlp.experts, part)
            err = (got - want).abs().max() / want.abs().max()
            assert 0 < err <= 0.25, f"{part}: transformers dequantised the file to {err:.3f} of the original's range"
    expected = hf_reference(hf, PROMPTS)
    eng = Engine(model=path, dtype="float32", page_size=16, attention_backend="trtllm_mha", max_total_tokens=2048)
    assert eng.cfg.quantization == "mxfp4"
    for layer in eng.runner.model.model.layers:  # held in 4 bits: blocks and scales as the file stores them
        experts = layer.mlp.experts
        assert experts.mxfp4 and not hasattr(experts, "gate_up_proj")
        assert experts.gate_up_proj_blocks.dtype == torch.uint8 and experts.down_proj_scales.dtype == torch.uint8
    sinks = [layer.self_attn.attn.sinks for layer in eng.runner.model.model.layers]
    assert all(s.dtype == torch.float32 and s.shape == (COMMON["num_attention_heads"],) for s in sinks)
    assert min(s.abs().min().item() for s in sinks) > 0, "every head's sink is random and non-zero"
    assert_matches(eng.generate(prompt_token_ids=PROMPTS, sampling=GREEDY), expected, "mxfp4")
    eng.check_no_leak()


@pytest.mark.parametrize("name", MODELS)
def test_routing_reads_nothing_back_from_the_device(name):
    """Router and experts on fake tensors (no values at all): a forward that read a routing
    result back to the host (`.item()`, `.tolist()`, a data-dependent shape) would raise here,
    and a CUDA graph could not capture it."""
    cfg = model_config_from_hf(tiny_config(name))
    block = SparseMoE(cfg.hidden_size, cfg.moe, cfg.rms_norm_eps, SINGLE_RANK)
    with FakeTensorMode(allow_non_fake_inputs=True):
        out = block(torch.randn(5, cfg.hidden_size))
    assert out.shape == (5, cfg.hidden_size)


@pytest.mark.parametrize(
    "name, change, message",
    [
        ("gemma4_moe", {"top_k_experts": 9}, "top_k_experts 9 exceeds num_experts 8"),
        ("gemma4_moe", {"moe_intermediate_size": None}, "moe_intermediate_size must be a positive integer"),
        ("gpt_oss", {"num_local_experts": 0}, "num_local_experts must be a positive integer"),
        ("gpt_oss", {"quantization_config": {"quant_method": "fp8"}}, "quant_method 'fp8' is not supported"),
        ("gemma4_moe", {"quantization_config": {"quant_method": "mxfp4"}}, "quant_method 'mxfp4' is not supported"),
        (
            "gpt_oss",
            {"intermediate_size": 48, "quantization_config": {"quant_method": "mxfp4"}},
            "intermediate_size 48 must be multiples of 32 for MXFP4 experts",
        ),
    ],
)
def test_configs_it_cannot_serve_are_refused_naming_the_field(name, change, message):
    hf = tiny_config(name)
    for field, value in change.items():
        setattr(hf, field, value)
    with pytest.raises(ValueError, match=message):
        model_config_from_hf(hf)


def test_experts_refuse_a_width_the_ranks_cannot_split():
    cfg = model_config_from_hf(tiny_config("gpt_oss", intermediate_size=30))
    with pytest.raises(ValueError, match="moe intermediate size 30 is not divisible by tp_size 4"):
        Experts(cfg.hidden_size, cfg.moe, _FakeGroup(4))


@pytest.mark.parametrize("tp, packed", [(1, True), (2, True), (4, False)])
def test_mxfp4_experts_stay_in_4_bits_where_each_ranks_share_splits_into_whole_groups(tp, packed):
    """64-wide experts: a rank's 64 or 32 intermediate columns hold whole 32-value groups (held as
    blocks and scales: half a byte a value and a byte a group of 32, 17/64 of bf16's bytes); 16 do
    not (dequantised)."""
    hf = tiny_config("gpt_oss", intermediate_size=64)
    hf.quantization_config = {"quant_method": "mxfp4"}
    cfg = model_config_from_hf(hf)
    experts = Experts(cfg.hidden_size, cfg.moe, _FakeGroup(tp))
    assert experts.mxfp4 == packed
    names = {name for name, _ in experts.named_parameters()}
    if packed:
        bf16_bytes = 2 * cfg.moe.num_experts * 3 * cfg.hidden_size * 64 // tp
        held = sum(p.numel() for n, p in experts.named_parameters() if n.endswith(("_blocks", "_scales")))
        assert held * 64 == bf16_bytes * 17
        assert not names & {"gate_up_proj", "down_proj"}
    else:
        assert {"gate_up_proj", "down_proj"} <= names


def test_expert_parallelism_refuses_experts_the_ranks_cannot_share(tmp_path):
    """`moe_parallel: expert` gives each rank whole experts: 8 over 3 ranks is refused naming the
    option (an intermediate size only the expert split can serve is taken), and the option's
    values are checked."""
    cfg = with_moe_parallel(model_config_from_hf(tiny_config("gpt_oss", intermediate_size=30)), "expert")
    Experts(cfg.hidden_size, cfg.moe, _FakeGroup(4))
    with pytest.raises(
        ValueError, match="moe_parallel: 'expert' needs num_experts divisible by tp_size; 8 experts over 3 "
    ):
        Experts(cfg.hidden_size, cfg.moe, _FakeGroup(3))
    tiny_config("gpt_oss").save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="moe_parallel: 'tensor' or 'expert', got 'data'"):
        Engine(model=str(tmp_path), load_format="dummy", max_total_tokens=256, moe_parallel="data")


def tiny_config(name: str, **overrides) -> transformers.PretrainedConfig:
    config_cls, model_cls, kwargs = TINY_MODELS[name]
    hf = getattr(transformers, config_cls)(**{**COMMON, **kwargs, **overrides})
    hf.architectures = [model_cls]
    return hf


class _FakeGroup:
    """Rank 0 of a group of `size`, for building layers (no collective is called)."""

    def __init__(self, size: int) -> None:
        self.rank, self.size = 0, size


@pytest.mark.parametrize("name", MODELS)
def test_random_weights_fill_the_experts_and_keep_router_scales_at_one(name, tmp_path):
    """`load_format="dummy"` (benchmarks): stacked expert matrices are drawn like any matrix, the
    router's scales stay at one."""
    tiny_config(name).save_pretrained(str(tmp_path))
    eng = Engine(model=str(tmp_path), load_format="dummy", page_size=16, max_total_tokens=512)
    routers = [m for m in eng.runner.model.modules() if isinstance(m, Router)]
    experts = [m for m in eng.runner.model.modules() if isinstance(m, Experts)]
    assert len(routers) == len(experts) == eng.cfg.num_layers
    assert all(e.gate_up_proj.std() > 0 and e.down_proj.std() > 0 for e in experts)
    assert all(float(r.per_expert_scale.min()) == 1.0 == float(r.scale.max()) for r in routers if r.norm is not None)
    (out,) = eng.generate(prompt_token_ids=PROMPTS[1:2], sampling=SamplingParams(max_new_tokens=4))
    assert len(out.token_ids) == 4
    eng.check_no_leak()
