"""The fused MoE kernels (workers/models/fused_moe.py) on the CPU through Triton's interpreter,
against the torch path, at the tiny test models' expert shapes (8 experts, 2 a token, 256 -> 32,
narrower than every tile of the kernels): 1 and 32 tokens (2 and 64 pairs, the GEMV-like
kernels), 33 and a 287-token prefill (66 and 574 pairs, the grouped GEMM); with an expert map
(each of two ranks holding half the experts), 32 and 287 tokens. In float32 they agree to float32
noise; in bfloat16 they round in the same places, so most outputs are equal. Skipped where triton
is not installed (CPU machines need not have it).

Triton reads TRITON_INTERPRET as it defines its own library, so the kernels run in a child
process that sets it (run as a module, this file prints their differences). The interpreter
handles bfloat16 unlike the GPU: `tl.dot` multiplies the operands' bits, not their values, and
float32 -> bfloat16 truncates; the child makes both do what the GPU does.
"""

import json

import pytest
import torch

from tests.triton_interpreter import as_the_gpu_does
from tests.triton_interpreter import interpreter_findings as run_interpreted
from tests.workers.test_gpu_moe import (
    KERNEL_NOISE,
    ROUNDING_NOISE,
    assert_rounding_noise,
    dealt_routing,
    differences,
    held_by,
    random_experts,
    skewed_routing,
)
from workers.models.moe import experts_torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BOUNDS = {"float32": (1e-5, 1e-6), "bfloat16": (KERNEL_NOISE, ROUNDING_NOISE)}  # (largest, mean) differences
CASES = [
    f"{shape}-{tokens}-{dtype}"
    for shape in ("tiny-gemma4-moe", "tiny-gpt-oss")
    for tokens in (1, 32, 33, 287)
    for dtype in DTYPES
]
EXPERT_MAP_CASES = [
    f"{shape}-{tokens}-bfloat16-map" for shape in ("tiny-gemma4-moe", "tiny-gpt-oss") for tokens in (32, 287)
]


def interpreted_differences() -> dict[str, list[float]]:
    """Each case's `differences` of the kernels from the torch path (under TRITON_INTERPRET=1)."""
    as_the_gpu_does()
    from workers.models.fused_moe import fused_experts

    out = {}
    for case in CASES:
        shape, tokens, dtype = case.rsplit("-", 2)
        tokens, dtype = int(tokens), DTYPES[dtype]
        num, top_k, hidden, act, experts = random_experts(shape, device="cpu", dtype=dtype)
        x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens)).to(dtype)
        weights, ids = skewed_routing(tokens, num, top_k, seed=tokens, device="cpu")
        gate_up, down, gate_up_bias, down_bias = experts
        ref = experts_torch(x, gate_up, down, weights, ids, act, gate_up_bias, down_bias)
        got = fused_experts(x, gate_up, down, weights, ids, act, gate_up_bias, down_bias)
        out[case] = differences(got, ref).tolist()
    for case in EXPERT_MAP_CASES:
        shape, tokens, dtype, _ = case.rsplit("-", 3)
        num, top_k, hidden, act, experts = random_experts(shape, device="cpu", dtype=DTYPES[dtype])
        x = torch.randn(int(tokens), hidden, generator=torch.Generator().manual_seed(int(tokens))).to(DTYPES[dtype])
        weights, ids = dealt_routing(int(tokens), num, top_k, seed=int(tokens), device="cpu")
        worst = torch.zeros(2)
        for rank in range(2):
            (gate_up, down, gate_up_bias, down_bias), expert_map = held_by(rank, 2, experts)
            args = (x, gate_up, down, weights, ids, act, gate_up_bias, down_bias, expert_map)
            worst = torch.maximum(worst, differences(fused_experts(*args), experts_torch(*args)))
        out[case] = worst.tolist()
    return out


@pytest.fixture(scope="module")
def interpreted() -> dict[str, list[float]]:
    return run_interpreted(__name__)


@pytest.mark.parametrize("case", CASES)
def test_fused_experts_match_the_torch_path_in_the_interpreter(interpreted, case):
    assert_rounding_noise(torch.tensor(interpreted[case]), case, BOUNDS[case.rsplit("-", 1)[1]])


@pytest.mark.parametrize("case", EXPERT_MAP_CASES)
def test_fused_experts_with_an_expert_map_match_the_torch_path_in_the_interpreter(interpreted, case):
    assert_rounding_noise(torch.tensor(interpreted[case]), case, BOUNDS["bfloat16"])


if __name__ == "__main__":
    print(json.dumps(interpreted_differences()))
