"""The fused MoE kernels (workers/models/fused_moe.py) on the CPU through Triton's interpreter,
against the torch path, at the tiny test models' expert shapes (8 experts, 2 a token, 256 -> 32,
narrower than every tile of the kernels), each path asked for: 1 and 32 tokens (2 and 64 pairs)
through the GEMV-like kernels, 33 and a 287-token prefill (66 and 574 pairs) through the grouped
GEMM; the GEMV-like kernels again reading their weights before the PDL wait as on Hopper (1 and
32 tokens); with an expert map (each of two ranks holding half the experts), 32 and 287 tokens;
gpt-oss's MXFP4 experts (read as stored, decoded in the kernels) at the tiny shape (1 and 8
tokens the GEMV, 32 and 287 the grouped GEMM, 600 dequantised first, bit for bit as the torch
path dequantises) and at gpt-oss-20b's for one token (several K tiles of several scale groups),
against the torch path dequantising the same codes, with and without a map. In float32 they
agree to float32 noise; in bfloat16 they round in the same places, so most outputs are equal.
The grouped GEMM's layout of the pairs (`align_on_device`, two kernels) is a stable sort's in torch
(`sorted_layout`) up to the order of pairs within an expert's run. Skipped where triton is not installed (CPU
machines need not have it).

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
    as_mxfp4,
    assert_rounding_noise,
    dealt_routing,
    differences,
    held_by,
    random_experts,
    random_router,
    skewed_routing,
)
from workers.models.moe import experts_torch, route

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BOUNDS = {"float32": (1e-5, 1e-6), "bfloat16": (KERNEL_NOISE, ROUNDING_NOISE)}  # (largest, mean) differences
# tokens -> the kernels they run (gemv_tiles.MOE_PATHS), asked for whatever the thresholds choose
PATHS = {1: "gemv", 8: "gemv", 32: "gemv", 33: "gemm", 287: "gemm", 600: "dequant"}
MXFP4_PATHS = {**PATHS, 32: "gemm"}
CASES = [
    f"{shape}-{tokens}-{dtype}"
    for shape in ("tiny-gemma4-moe", "tiny-gpt-oss")
    for tokens in (1, 32, 33, 287)
    for dtype in DTYPES
]
# the GEMV-like kernels reading each program's expert rows before the PDL wait, as on Hopper
# (the down kernel always, the gate/up kernel where the routing came a kernel earlier)
PRELOADED_CASES = [
    f"{shape}-{tokens}-{dtype}-preloaded"
    for shape in ("tiny-gemma4-moe", "tiny-gpt-oss")
    for tokens in (1, 32)
    for dtype in DTYPES
]
# the router kernels (workers/models/fused_router.py): Gemma 4's (norm, scales, 128 experts, top 8)
# and gpt-oss's (bias, 32 experts, top 4) at 1 and 8 tokens; at 8 also with the weights read before
# the PDL wait, as on Hopper
ROUTER_CASES = [
    f"{family}-{tokens}-{dtype}" for family in ("gemma4", "gpt-oss") for tokens in (1, 8) for dtype in DTYPES
] + [f"{family}-8-{dtype}-preloaded" for family in ("gemma4", "gpt-oss") for dtype in DTYPES]
EXPERT_MAP_CASES = [
    f"{shape}-{tokens}-bfloat16-map" for shape in ("tiny-gemma4-moe", "tiny-gpt-oss") for tokens in (32, 287)
]
MXFP4_CASES = [f"tiny-gpt-oss-{tokens}-{dtype}" for tokens in (1, 8, 32, 287, 600) for dtype in DTYPES] + [
    "gpt-oss-20b-1-bfloat16",
    "tiny-gpt-oss-32-bfloat16-map",
    "tiny-gpt-oss-287-bfloat16-map",
]

# (tokens, experts, top k, tile height, whether half the experts are held elsewhere): the grouped
# GEMM's layout of routed pairs, from a decode batch to a prefill, uneven loads, empty experts
ALIGN_CASES = [
    f"{tokens}-{experts}-{top_k}-{block_m}{'-map' if mapped else ''}"
    for tokens, experts, top_k, block_m, mapped in (
        (1, 8, 2, 64, False),
        (33, 8, 2, 64, False),
        (287, 8, 2, 64, True),
        (5, 128, 8, 16, False),
        (64, 128, 8, 64, True),
        (1024, 32, 4, 64, False),
    )
]


def sorted_layout(
    ids: torch.Tensor, num_experts: int, block_m: int, expert_map: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`align_on_device`'s layout from torch ops, the oracle: a stable sort by expert, each run
    padded to `block_m` with the pair count as filler, tiles past the experts' runs (and the run
    of pairs held elsewhere, with a map) marked `num_experts`."""
    from workers.models.fused_moe import aligned_rows

    flat = ids.reshape(-1)
    runs = num_experts
    if expert_map is not None:
        flat = expert_map[flat]
        flat = torch.where(flat >= 0, flat, num_experts)
        runs += 1
    pairs = flat.numel()
    counts = torch.zeros(runs, dtype=torch.int64).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    rank = torch.arange(pairs) - (torch.cumsum(counts, 0) - counts)[expert]
    rows = aligned_rows(pairs, runs, block_m)
    pair_of_row = torch.full((rows,), pairs, dtype=torch.int32)
    pair_of_row[(ends - padded)[expert] + rank] = order.to(torch.int32)
    block_expert = torch.searchsorted(ends[:num_experts], torch.arange(0, rows, block_m), right=True)
    return pair_of_row, block_expert.to(torch.int32)


def _align_findings(case: str) -> dict:
    """`align_on_device` against `sorted_layout`: the same tile experts and filler rows, every
    row in the same expert's run, every pair in exactly one row."""
    from workers.models.fused_moe import align_on_device

    tokens, experts, top_k, block_m, *mapped = case.split("-")
    tokens, experts, top_k, block_m = int(tokens), int(experts), int(top_k), int(block_m)
    _, ids = skewed_routing(tokens, experts, top_k, seed=tokens, device="cpu")
    held = experts
    expert_map = None
    if mapped:
        held = experts // 2
        expert_map = torch.where(torch.arange(experts) < held, torch.arange(experts), -1)
    ref_rows, ref_tiles = sorted_layout(ids, held, block_m, expert_map)
    rows, tiles = align_on_device(ids, held, block_m, expert_map)
    pairs = ids.numel()
    flat = ids.reshape(-1)
    run = flat if expert_map is None else torch.where(expert_map[flat] >= 0, flat, held)
    filled = rows < pairs
    return {
        "shapes_equal": rows.shape == ref_rows.shape and tiles.shape == ref_tiles.shape,
        "tiles_equal": bool(torch.equal(tiles, ref_tiles)),
        "fillers_equal": bool(torch.equal(filled, ref_rows < pairs)),
        "runs_equal": bool(torch.equal(run[rows[filled].long()], run[ref_rows[ref_rows < pairs].long()])),
        "each_pair_once": bool(torch.equal(rows[filled].sort().values, torch.arange(pairs, dtype=rows.dtype))),
    }


def _router_findings(case: str) -> dict:
    """The logits kernel against the torch path's logits (largest difference in ulps of the
    model's dtype, share unequal), and the top-k kernel over those same logits against `route`:
    equal ids (float32 logits have no ties), the weights' largest difference; and the order of
    tied logits."""
    from workers.models import fused_router

    preloaded = case.endswith("-preloaded")  # the router's rows read before the PDL wait, as on Hopper
    fused_router.preloads = lambda: preloaded
    family, tokens, dtype = case.removesuffix("-preloaded").rsplit("-", 2)
    router = random_router(family, DTYPES[dtype])
    hidden = router.proj.weight.shape[1]
    x = torch.randn(int(tokens), hidden, generator=torch.Generator().manual_seed(int(tokens))).to(DTYPES[dtype])
    with torch.no_grad():
        gemma = router.norm is not None
        norm = (router.scale, router.norm.eps, router.input_scale) if gemma else None
        got = fused_router.logits(x, router.proj.weight, router.proj.bias, norm)
        ref = router.proj(router.norm(x) * router.scale * router.input_scale if gemma else x)
        expert_scale = router.per_expert_scale.float() if gemma else None
        # one launch: the top-k in the program that stores a token's last logit, over the stored logits
        fused = fused_router.route(x, router.proj.weight, router.proj.bias, router.top_k, norm, expert_scale)
        apart = fused_router.top_k_of(got, router.top_k, expert_scale)
        spacing = torch.exp2(torch.floor(torch.log2(ref.float().abs().clamp_min(2**-100))) - 7)
        scores = torch.randn(int(tokens), ref.shape[1], generator=torch.Generator().manual_seed(7))
        weights, ids = fused_router.top_k_of(scores, router.top_k, expert_scale)
        ref_weights, ref_ids = route(scores, router.top_k, expert_scale)
        # equal logits: the lower expert id first (3 and 6 tie for the fourth place)
        _, tied = fused_router.top_k_of(torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, -1.0, 2.0, 0.5]]), 4)
    return {
        "ties_lowest_first": tied.tolist() == [[1, 2, 4, 3]],
        "logit_ulps": float(((got.float() - ref.float()).abs() / spacing).max()),
        "unequal": float((got != ref).float().mean()),
        "relative": float((got.float() - ref.float()).norm() / ref.float().norm()),
        "ids_equal": bool(torch.equal(ids, ref_ids)),
        "weights": float((weights - ref_weights).abs().max()),
        "one_launch_equal": all(torch.equal(f, a) for f, a in zip(fused, apart)),
    }


def interpreted_differences() -> dict[str, list[float] | dict]:
    """Each case's `differences` of the kernels from the torch path (under TRITON_INTERPRET=1),
    and the router cases' findings."""
    as_the_gpu_does()
    from workers.models import fused_moe
    from workers.models.fused_moe import fused_experts

    out = {}
    for case in CASES + PRELOADED_CASES:
        preloaded = case.endswith("-preloaded")
        fused_moe.preloads = lambda preloaded=preloaded: preloaded
        shape, tokens, dtype = case.removesuffix("-preloaded").rsplit("-", 2)
        tokens, dtype = int(tokens), DTYPES[dtype]
        num, top_k, hidden, act, experts = random_experts(shape, device="cpu", dtype=dtype)
        x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens)).to(dtype)
        weights, ids = skewed_routing(tokens, num, top_k, seed=tokens, device="cpu")
        gate_up, down, gate_up_bias, down_bias = experts
        ref = experts_torch(x, gate_up, down, weights, ids, act, gate_up_bias, down_bias)
        args = (x, gate_up, down, weights, ids, act, gate_up_bias, down_bias)
        got = fused_experts(*args, path=PATHS[tokens], routed_early=preloaded)
        out[case] = differences(got, ref).tolist()
    fused_moe.preloads = lambda: False
    for case in EXPERT_MAP_CASES:
        shape, tokens, dtype, _ = case.rsplit("-", 3)
        num, top_k, hidden, act, experts = random_experts(shape, device="cpu", dtype=DTYPES[dtype])
        x = torch.randn(int(tokens), hidden, generator=torch.Generator().manual_seed(int(tokens))).to(DTYPES[dtype])
        weights, ids = dealt_routing(int(tokens), num, top_k, seed=int(tokens), device="cpu")
        worst = torch.zeros(2)
        for rank in range(2):
            (gate_up, down, gate_up_bias, down_bias), expert_map = held_by(rank, 2, experts)
            args = (x, gate_up, down, weights, ids, act, gate_up_bias, down_bias, expert_map)
            got = fused_experts(*args, path=PATHS[int(tokens)])
            worst = torch.maximum(worst, differences(got, experts_torch(*args)))
        out[case] = worst.tolist()
    for case in MXFP4_CASES:
        mapped = case.endswith("-map")
        shape, tokens, dtype = case.removesuffix("-map").rsplit("-", 2)
        num, top_k, hidden, act, experts = random_experts(shape, device="cpu", dtype=DTYPES[dtype])
        experts = as_mxfp4(experts)
        x = torch.randn(int(tokens), hidden, generator=torch.Generator().manual_seed(int(tokens))).to(DTYPES[dtype])
        weights, ids = dealt_routing(int(tokens), num, top_k, seed=int(tokens), device="cpu")
        worst = torch.zeros(2)
        for rank in range(2 if mapped else 1):
            held, expert_map = held_by(rank, 2, experts) if mapped else (experts, None)
            args = (x, *held[:2], weights, ids, act, *held[2:], expert_map)
            got = fused_experts(*args, path=MXFP4_PATHS[int(tokens)])
            worst = torch.maximum(worst, differences(got, experts_torch(*args)))
        out[f"mxfp4-{case}"] = worst.tolist()
        if int(tokens) > 300 and not mapped:
            from workers.models.fused_moe import dequantize_experts

            out[f"dequantized-{case}"] = all(
                torch.equal(dequantize_experts(w, x.dtype), torch.stack([w.expert(e, x.dtype) for e in range(num)]))
                for w in experts[:2]
            )
    for case in ROUTER_CASES:
        out[f"router-{case}"] = _router_findings(case)
    for case in ALIGN_CASES:
        out[f"align-{case}"] = _align_findings(case)
    return out


@pytest.fixture(scope="module")
def interpreted() -> dict[str, list[float]]:
    return run_interpreted(__name__, timeout=1800)  # gpt-oss-20b's MXFP4 experts: about ten minutes on two cores


@pytest.mark.parametrize("case", CASES + PRELOADED_CASES)
def test_fused_experts_match_the_torch_path_in_the_interpreter(interpreted, case):
    assert_rounding_noise(
        torch.tensor(interpreted[case]), case, BOUNDS[case.removesuffix("-preloaded").rsplit("-", 1)[1]]
    )


@pytest.mark.parametrize("case", EXPERT_MAP_CASES)
def test_fused_experts_with_an_expert_map_match_the_torch_path_in_the_interpreter(interpreted, case):
    assert_rounding_noise(torch.tensor(interpreted[case]), case, BOUNDS["bfloat16"])


@pytest.mark.parametrize("case", MXFP4_CASES)
def test_mxfp4_fused_experts_match_the_torch_path_in_the_interpreter(interpreted, case):
    dtype = case.removesuffix("-map").rsplit("-", 1)[1]
    assert_rounding_noise(torch.tensor(interpreted[f"mxfp4-{case}"]), case, BOUNDS[dtype])


@pytest.mark.parametrize("case", [c for c in MXFP4_CASES if c.rsplit("-", 2)[1] == "600"])
def test_mxfp4_experts_dequantise_as_the_torch_path_does_in_the_interpreter(interpreted, case):
    assert interpreted[f"dequantized-{case}"]


@pytest.mark.parametrize("case", ROUTER_CASES)
def test_router_kernels_match_the_torch_path_in_the_interpreter(interpreted, case):
    """Logits equal in float32 to float32 noise, in bfloat16 equal but for a few a rounding apart
    (whose float32 statistics round the other way), and the same experts in the same order with
    softmax weights to float32 noise."""
    found = interpreted[f"router-{case}"]
    if "float32" in case:
        assert found["relative"] <= 1e-6, found
    else:
        assert found["logit_ulps"] <= 1.0 and found["unequal"] <= 0.02, found
    assert found["ids_equal"] and found["weights"] <= 1e-6, found
    assert found["one_launch_equal"], found  # the logits kernel's own top-k: the two kernels' result
    assert found["ties_lowest_first"], found


@pytest.mark.parametrize("case", ALIGN_CASES)
def test_pairs_are_laid_out_on_the_device_as_the_torch_oracle_lays_them_out_in_the_interpreter(interpreted, case):
    found = interpreted[f"align-{case}"]
    assert all(found.values()), found


if __name__ == "__main__":
    print(json.dumps(interpreted_differences()))
