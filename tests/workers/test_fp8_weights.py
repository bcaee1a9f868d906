"""FP8 weights on the CPU (docs/design.md §4.9): tiny random Hugging Face models quantised here as
FP8 checkpoints ship, per tensor (`weight_scale` and static `input_scale`, AutoFP8's) and in 16 x 16 blocks
(`weight_scale_inv` with `weight_block_size`, as Qwen3-FP8's 128 x 128 blocks), load as FP8 and give
the greedy tokens and logits of transformers' model holding the dequantised weights; two ranks give
one rank's tokens; `quantization: fp8` quantises a float checkpoint per output channel at load;
dummy FP8 weights carry real scales; configurations slidespec does not serve are refused, naming
the field. The quantisation here is written from the formats' definitions, apart from slidespec's."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.hf_models import make_tiny_model, random_prompts
from tests.workers.rank_group import FIRST, GREEDY, PROMPTS
from workers.engine import Engine, SamplingParams

E4M3 = torch.float8_e4m3fn
BLOCK = (16, 16)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NEW_TOKENS = 24
PROMPT_LENS = [29, 11, 40]


def _to_e4m3(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w / scale).clamp(-448.0, 448.0).to(E4M3)


def _per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(FP8 weight, its one scale, the weight it stands for)."""
    scale = w.abs().max() / 448.0
    q = _to_e4m3(w, scale)
    return q, scale.reshape(()), q.float() * scale


def _per_channel(w: torch.Tensor) -> torch.Tensor:
    """The weight a scale per row stands for."""
    scale = w.abs().amax(dim=1, keepdim=True) / 448.0
    return _to_e4m3(w, scale).float() * scale


def _per_block(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(FP8 weight, a scale per block, the weight it stands for), block by block."""
    rows, cols = block
    q = torch.empty(w.shape, dtype=E4M3)
    scales = torch.empty(-(-w.shape[0] // rows), -(-w.shape[1] // cols))
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            part = w[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols]
            scales[i, j] = part.abs().max() / 448.0
            q[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols] = _to_e4m3(part, scales[i, j])
    per_weight = scales.repeat_interleave(rows, 0)[: w.shape[0]].repeat_interleave(cols, 1)[:, : w.shape[1]]
    return q, scales, q.float() * per_weight


def _projection(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS


def write_fp8_checkpoint(src: str, dst: str, layout: str) -> dict[str, torch.Tensor]:
    """An FP8 copy of the model in `src` at `dst` ("per_tensor" or "block"); returns the
    dequantised weights of its projections."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    tensors, dequantised = load_file(path), {}
    for name in [n for n in tensors if _projection(n)]:
        w = tensors[name].float()
        if layout == "per_tensor":  # with the static activation scales AutoFP8 ships (slidespec reads none)
            q, scale, dequantised[name] = _per_tensor(w)
            tensors[name[: -len("weight")] + "weight_scale"] = scale
            tensors[name[: -len("weight")] + "input_scale"] = torch.tensor(0.05)
        else:
            q, scale, dequantised[name] = _per_block(w, BLOCK)
            tensors[name[: -len("weight")] + "weight_scale_inv"] = scale
        tensors[name] = q
    save_file(tensors, path)
    quant = {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}
    if layout == "block":  # as Qwen3-FP8's config states it
        quant = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": list(BLOCK)}
    _edit_config(dst, quantization_config=quant)
    return dequantised


def _edit_config(path: str, **fields) -> None:
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config.update(fields)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


def _hf_greedy(hf, weights: dict[str, torch.Tensor], prompts: list[list[int]]) -> tuple[list, list]:
    """transformers' greedy tokens and per-step logits with `weights` in place of its own."""
    hf.load_state_dict(weights, strict=False)
    tokens, logits = [], []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
            tokens.append(gen[0, len(prompt) :].tolist())
            logits.append(hf(gen[:, :-1]).logits[0, len(prompt) - 1 :].float())
    return tokens, logits


def _engine(path: str, **kw) -> Engine:
    return Engine(
        model=path, device="cpu", dtype="float32", attention_backend="torch_native", max_total_tokens=4096, **kw
    )


def _matches(engine: Engine, prompts: list[list[int]], tokens: list, logits: list) -> None:
    sp = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, return_logits=True)
    for i, out in enumerate(engine.generate(prompt_token_ids=prompts, sampling=sp)):
        diff = (torch.stack(out.logits) - logits[i]).abs().max().item()
        assert diff <= 1e-4, f"prompt {i}: max |logit diff| {diff:.2e}"
        assert out.token_ids == tokens[i], f"prompt {i}: greedy tokens differ from transformers'"
    engine.check_no_leak()


@pytest.fixture(scope="module", params=["gemma3", "qwen2"])
def tiny(request, tmp_path_factory):
    """(name, float checkpoint, transformers' model): Gemma 3's hybrid SWA layers, Qwen2's biases."""
    path = str(tmp_path_factory.mktemp(request.param) / "bf16")
    return request.param, path, make_tiny_model(request.param, path)


@pytest.mark.parametrize("layout", ["per_tensor", "block"])
def test_fp8_checkpoints_give_transformers_tokens_on_the_dequantised_model(tiny, layout, tmp_path):
    _, path, hf = tiny
    fp8_dir = str(tmp_path / layout)
    dequantised = write_fp8_checkpoint(path, fp8_dir, layout)
    prompts = random_prompts(PROMPT_LENS)
    original = {k: v.clone() for k, v in hf.state_dict().items()}
    tokens, logits = _hf_greedy(hf, dequantised, prompts)
    hf.load_state_dict(original)
    engine = _engine(fp8_dir)
    qkv = engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == E4M3 and qkv.weight_scale.dim() == (2 if layout == "block" else 1)
    _matches(engine, prompts, tokens, logits)


def test_quantization_fp8_quantises_a_float_checkpoint_per_channel(tiny):
    _, path, hf = tiny
    prompts = random_prompts(PROMPT_LENS, seed=1)
    original = {k: v.clone() for k, v in hf.state_dict().items()}
    per_channel = {k: _per_channel(v) for k, v in original.items() if _projection(k)}
    tokens, logits = _hf_greedy(hf, per_channel, prompts)
    hf.load_state_dict(original)
    _matches(_engine(path, quantization="fp8"), prompts, tokens, logits)


@pytest.mark.parametrize("layout", ["per_tensor", "block"])
def test_two_ranks_give_one_ranks_tokens(tmp_path, tp2, layout):
    """Two ranks (gloo) split every FP8 projection with its scales: per-tensor scales on each
    rank's rows, blocks by whole blocks (a rank holds one of the two KV heads: one 16-row block)."""
    path = str(tmp_path / "gemma3")
    make_tiny_model("gemma3", path)
    write_fp8_checkpoint(path, str(tmp_path / layout), layout)
    kwargs = dict(model=str(tmp_path / layout), page_size=4, chunked_prefill_size=8, max_total_tokens=2048)
    single = Engine(**kwargs)
    ref = single.generate(prompt_token_ids=FIRST, sampling=GREEDY)
    ref += single.generate(prompt_token_ids=PROMPTS[len(FIRST) :], sampling=GREEDY)
    got = tp2.run_each([kwargs])[0]
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]


def test_dummy_fp8_weights_have_the_scales_of_their_values(tmp_path):
    """Benchmarks' dummy FP8 weights: values drawn as dummy weights are, then quantised, so every
    row reaches the format's largest value and the scales are those values' (std 0.08 here)."""
    path = str(tmp_path / "llama")
    make_tiny_model("llama", path)
    engine = Engine(model=path, load_format="dummy", quantization="fp8", max_total_tokens=256)
    proj = engine.runner.model.model.layers[0].mlp.down_proj
    assert proj.weight.dtype == E4M3
    assert torch.equal(proj.weight.float().abs().amax(dim=1), torch.full((proj.weight.shape[0],), 448.0))
    dequantised = proj.weight.float() * proj.weight_scale[:, None]
    assert 0.06 < dequantised.std().item() < 0.10


@pytest.mark.parametrize(
    "quant, field",
    [
        ({"quant_method": "awq", "bits": 4}, "quantization_config.quant_method"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "quantization_config.fmt"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "quantization_config.weight_block_size"),
        ({"quant_method": "fp8", "weight_block_size": [48, 16]}, "quantization_config.weight_block_size"),
        ({"quant_method": "fp8", "modules_to_not_convert": ["o_proj"]}, "quantization_config.modules_to_not_convert"),
    ],
)
def test_unserved_quantisation_is_refused_naming_the_field(tmp_path, quant, field):
    """A method slidespec does not load, an FP8 format or block layout it does not read (48-row
    blocks do not stack q's 64 rows and k's 32), a projection left unquantised among FP8 ones."""
    path = str(tmp_path / "llama")
    make_tiny_model("llama", path)
    _edit_config(path, quantization_config=quant)
    with pytest.raises(ValueError, match=field):
        Engine(model=path, load_format="dummy", max_total_tokens=256)


def test_an_unknown_quantization_option_is_refused(tmp_path):
    path = str(tmp_path / "llama")
    make_tiny_model("llama", path)
    with pytest.raises(ValueError, match=r"quantization: unknown 'int8'; allowed: \[None, 'fp8'\]"):
        Engine(model=path, quantization="int8", max_total_tokens=256)
