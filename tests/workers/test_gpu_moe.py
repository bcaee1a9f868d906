"""The fused MoE kernels on the GPU against the torch path, their oracle (workers/models/moe.py).

At the experts' real shapes (Gemma-4-26B-A4B: 128 experts, top 8, 2816 -> 704, GELU-tanh;
gpt-oss-20b: 32 experts, top 4, 2880 -> 2880, clamped SwiGLU with biases), bf16, for batches of 1
and 8 (the GEMV-like kernels) and 64 and a 300-token prefill (the grouped GEMM), with uneven
expert loads and experts that receive no token: within bf16 noise of the torch path. Under a
CUDA graph a replay with new routing gives the new routing's result, and an eager call never
synchronises with the host. End to end, the tiny Gemma 4 MoE and gpt-oss models (bf16,
trtllm_mha, CUDA graphs) give the torch path's logits within bf16 noise.
"""

import pytest
import torch

from tests.hf_models import make_tiny_model, random_prompts
from tests.workers.test_gpu_engine import compare_bf16_runs
from workers.engine import Engine, SamplingParams
from workers.models import moe
from workers.models.moe import Activation, experts_torch, route

pytestmark = pytest.mark.gpu

# name -> (experts, top k, hidden, intermediate, activation, biases)
SHAPES = {
    "gemma-4-26b-a4b": (128, 8, 2816, 704, "gelu_pytorch_tanh", False),
    "gpt-oss-20b": (32, 4, 2880, 2880, "swiglu_clamped", True),
}
KERNEL_NOISE = 2.0**-6  # of the largest output: bf16 rounding of the intermediate rows and the sums
MODEL_NOISE = 2.0**-4  # of the largest logit, through a random tiny model's layers; a wrong kernel is off by O(1)


def _experts(shape: str, seed: int = 0) -> tuple:
    num, top_k, hidden, width, act, bias = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*size, std=0.02):
        return (torch.randn(*size, generator=g, device="cuda") * std).to(torch.bfloat16)

    weights = (
        rand(num, 2 * width, hidden),
        rand(num, hidden, width),
        rand(num, 2 * width, std=0.1) if bias else None,
        rand(num, hidden, std=0.1) if bias else None,
    )
    return num, top_k, hidden, Activation(act, 1.702, 7.0), weights


def _routing(tokens: int, num: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Skewed routing: the first experts take most tokens, the last quarter none."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(tokens, num, generator=g, device="cuda") + torch.linspace(4.0, -4.0, num, device="cuda")
    logits[:, -num // 4 :] = -1e4
    return route(logits, top_k)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("tokens", [1, 8, 64, 300])
def test_fused_experts_match_the_torch_path(shape, tokens):
    from workers.models.fused_moe import fused_experts

    num, top_k, hidden, act, (gate_up, down, gate_up_bias, down_bias) = _experts(shape)
    x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
    weights, ids = _routing(tokens, num, top_k, seed=tokens)
    ref = experts_torch(x, gate_up, down, weights, ids, act, gate_up_bias, down_bias).float()
    got = fused_experts(x, gate_up, down, weights, ids, act, gate_up_bias, down_bias).float()
    rel = ((got - ref).abs().max() / ref.abs().max()).item()
    assert rel <= KERNEL_NOISE, f"{shape} {tokens} tokens: {rel:.3g} of the largest output"
    assert ids.unique().numel() < num, "some expert should receive no token"


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("tokens", [1, 64])
def test_fused_experts_replay_new_routing_and_never_synchronise(shape, tokens):
    from workers.models.fused_moe import fused_experts

    num, top_k, hidden, act, (gate_up, down, gate_up_bias, down_bias) = _experts(shape)
    x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
    weights, ids = _routing(tokens, num, top_k, seed=1)

    def run():
        return fused_experts(x, gate_up, down, weights, ids, act, gate_up_bias, down_bias)

    torch.cuda.set_sync_debug_mode("error")
    try:
        run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # warm-up outside the capture (Triton compiles here)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    new_weights, new_ids = _routing(tokens, num, top_k, seed=2)
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    x.copy_(torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16))
    graph.replay()
    ref = experts_torch(x, gate_up, down, weights, ids, act, gate_up_bias, down_bias).float()
    rel = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    assert rel <= KERNEL_NOISE, f"{shape} {tokens} tokens, replayed: {rel:.3g} of the largest output"


@pytest.mark.parametrize("name", ["gemma4_moe", "gpt_oss"])
def test_tiny_moe_models_match_the_torch_path(tmp_path, monkeypatch, name):
    """Whole models, prefill (grouped GEMM) and decode (GEMV) under CUDA graphs: the fused
    experts' logits against the torch path's, up to each request's first differing token."""
    path = str(tmp_path / name)
    make_tiny_model(name, path, hidden_size=256, head_dim=64, num_attention_heads=4, num_key_value_heads=2)
    prompts = random_prompts([150, 40, 97])
    sp = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True, return_logits=True)
    runs = {}
    for fused in (False, True):
        monkeypatch.setattr(moe, "FUSED_MOE", fused)
        eng = Engine(
            model=path,
            device="cuda",
            dtype="bfloat16",
            page_size=16,
            attention_backend="trtllm_mha",
            max_total_tokens=8192,
            context_length=1024,
            max_running_requests=4,
        )
        runs[fused] = eng.generate(prompt_token_ids=prompts, sampling=sp)
        eng.check_no_leak()
        del eng
        torch.cuda.empty_cache()
    compare_bf16_runs(runs[False], runs[True], f"{name} fused experts", noise=MODEL_NOISE)
