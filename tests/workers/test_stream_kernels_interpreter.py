"""The kernels that finish a Gemma 4 layer's stream on CUDA, on the CPU through Triton's
interpreter, against the torch op set (the reference the model's CPU path runs, equal to Hugging
Face's): the sandwich kernel with the layer scalar (norm, add, scale and the next layer's norm;
and stopping at the stream; and adding two normed rows), the one-row norm GEMV with the scalar
and without its norm (the stream projected as it is: the per-layer input gate) and from a
token's embedding row, the gated GEMV that computes act(gate) * per-layer input inside the
projection (and the MLP's gate/up GEMV with its activation, with and without its first weight
tile read before the PDL wait; and the plain one-row GEMV over looped and unrolled K, and with K
shared between programs, some starting past K), and the RoPE kernel normalising each value
head as it writes it to the paged cache. In float32 they agree to float32 noise; in
bfloat16 the norm kernels round where the torch ops round (at most one rounding apart), and the
gated GEMV and the gate/up GEMV, which round once where the torch ops round two or three times,
are no further than they are from float32 math over the same inputs.
Skipped where triton is not installed (CPU machines need not have it).

Triton reads TRITON_INTERPRET as it defines its own library, so the kernels run in a child
process that sets it (run as a module, this file prints their differences).
"""

import json

import pytest
import torch

from tests.triton_interpreter import as_the_gpu_does
from tests.triton_interpreter import interpreter_findings as run_interpreted
from workers.models.layers import rope_cache
from workers.models.ops import TORCH_OPS

EPS = 1e-6
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# (kernel, rows, width, dtype): widths that are not powers of two, Gemma-4-E4B's hidden size
CASES = [
    f"{kernel}-{rows}-{width}-{dtype}"
    for kernel, shapes in (
        ("norm_add_norm", ((1, 2560), (5, 96))),
        ("norm_add", ((1, 2560), (3, 96))),
        ("norms_add", ((1, 2816), (3, 96))),
        ("norm_gemv", ((1, 96), (1, 200))),
        ("stream_gemv", ((1, 96), (1, 200))),
        ("embed_gemv", ((1, 96), (1, 200))),
        ("gated_gemv", ((1, 256), (1, 24))),
        ("act_mul", ((1, 2560), (1, 200))),
        ("act_mul_early", ((1, 2560), (1, 200))),
        ("gemv", ((1, 2560), (1, 7000))),
        ("gemv_splits", ((1, 1024), (1, 1000))),
        ("rope_v_norm", ((1, 256), (7, 64))),
    )
    for rows, width in shapes
    for dtype in DTYPES
]


def _ulps(got: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest difference in units of bfloat16's spacing around the reference's values."""
    ulp = torch.exp2(torch.floor(torch.log2(ref.float().abs().clamp_min(2**-100))) - 7)
    return float(((got.float() - ref.float()).abs() / ulp).max())


def _relative(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref.float()).norm() / ref.float().norm())


def _one(kernel: str, rows: int, width: int, dtype: torch.dtype) -> dict:
    from workers.models import gemv, sandwich_norm

    gen = torch.Generator().manual_seed(rows * 1000 + width)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    x, residual, before, norm = rand(rows, width), rand(rows, width), rand(width), rand(width)
    scale = torch.tensor([0.75], dtype=dtype)
    if kernel == "norm_add_norm":
        got = sandwich_norm.norm_add_norm(x, residual.clone(), before, norm, EPS, False, scale)
        ref = TORCH_OPS.add_rms_norm(x, residual, norm, EPS, False, before, scale)
    elif kernel == "norm_add":
        got = (sandwich_norm.norm_add(x, residual.clone(), before, EPS, False, scale),)
        ref = (TORCH_OPS.add_rms_norm(x, residual, norm, EPS, False, before, scale)[1],)
    elif kernel == "norms_add":  # two normed rows added (Gemma 4's MoE-block branches: Gemma norms, no scale)
        got = (sandwich_norm.norm_add(x, residual.clone(), before, EPS, True, None, norm),)
        ref = (TORCH_OPS.rms_norm(residual, norm, EPS, True) + TORCH_OPS.rms_norm(x, before, EPS, True),)
    elif kernel in ("norm_gemv", "stream_gemv"):
        weight = rand(40, width)
        normed = norm if kernel == "norm_gemv" else None
        got = gemv.add_norm_gemv(x, residual, normed, EPS, False, before, weight, None, scale)
        ref = TORCH_OPS.add_rms_norm_linear(x, residual, normed, EPS, False, before, weight, None, scale)
    elif kernel == "embed_gemv":  # the first layer's: the token's embedding row, scaled, normed and projected
        weight, table, token = rand(40, width), rand(50, width), torch.tensor([7])
        got = gemv.embed_norm_gemv(token, table, width**0.5, norm, EPS, False, weight, None)
        ref = TORCH_OPS.embed_rms_norm_linear(token, table, width**0.5, norm, EPS, False, weight, None)
    elif kernel == "rope_v_norm":
        return _rope_v_norm(rows, width, dtype, gen)
    elif kernel.startswith("act_mul"):  # `_early`: the first K tile read before the PDL wait, as on Hopper
        gemv.preloads = lambda: kernel.endswith("_early")
        weight = rand(2 * 40, width)
        got = gemv.gemv_act_and_mul(x, weight, "gelu_pytorch_tanh")
        ref = TORCH_OPS.linear_act_and_mul(x, weight, None, "gelu_pytorch_tanh")
        exact = TORCH_OPS.linear_act_and_mul(x.float(), weight.float(), None, "gelu_pytorch_tanh")
        return {"kernel": _relative(got, exact), "torch": _relative(ref, exact)}
    elif kernel.startswith("gemv"):  # looped (2560) and unrolled (7000) K; `_splits`: K shared by 12
        weight = rand(40, width)  # unrolled splits of 128, the last four starting past K; K 1024 ends a split
        tile = gemv.Tile(4, 64, 4, 1, splits=12, unroll=True) if kernel.endswith("_splits") else None
        got = gemv.gemv(x, weight, tile=tile)
        ref = TORCH_OPS.linear(x, weight, None)
        exact = TORCH_OPS.linear(x.float(), weight.float(), None)
        return {"kernel": _relative(got, exact), "torch": _relative(ref, exact)}
    else:
        weight = rand(2560 if width == 256 else 40, width)
        got = gemv.gated_gemv(x, residual, "gelu_pytorch_tanh", weight)
        ref = TORCH_OPS.gated_linear(x, residual, "gelu_pytorch_tanh", weight, None)
        exact = TORCH_OPS.gated_linear(x.float(), residual.float(), "gelu_pytorch_tanh", weight.float(), None)
        return {"kernel": _relative(got, exact), "torch": _relative(ref, exact)}
    return {
        "ulps": max(_ulps(g, r) for g, r in zip(got, ref)),
        "relative": max(_relative(g, r) for g, r in zip(got, ref)),
        "unequal": max(float((g != r).float().mean()) for g, r in zip(got, ref)),
    }


def _rope_v_norm(tokens: int, head_dim: int, dtype: torch.dtype, gen: torch.Generator) -> dict:
    """RoPE with q/k norms writing keys and values into a paged cache, each value head normed
    first (Gemma 4; V the K projection's output, as its full layers have it): the queries and
    the cache against the torch op's."""
    from workers.models import rope

    q_heads, k_heads, page = 4, 2, 16
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    cos_sin = rope_cache(inv_freq, 1.0, 512)
    positions = torch.randint(0, 512, (tokens,), generator=gen)
    qk = torch.randn(tokens, (q_heads + k_heads) * head_dim, generator=gen).to(dtype)
    q = qk[:, : q_heads * head_dim].reshape(tokens, q_heads, head_dim)
    k = qk[:, q_heads * head_dim :].reshape(tokens, k_heads, head_dim)
    norms = (*(torch.randn(head_dim, generator=gen).to(dtype) for _ in "qk"), EPS, False)
    slots = torch.randperm(4 * page, generator=gen)[:tokens] + page
    ref_cache, got_cache = (torch.zeros(5, 2, k_heads, page, head_dim, dtype=dtype) for _ in "rg")
    v = qk[:, q_heads * head_dim :]
    ref_q, _ = TORCH_OPS.rope(positions, q, k, cos_sin, norms, (ref_cache, slots, v, (1.0, 1.0)), EPS)
    got_q, _ = rope.rope(positions, q, k, cos_sin, norms, (got_cache, slots, v, (1.0, 1.0)), EPS)
    values = got_cache[:, 1]
    normed = values[values.abs().sum(-1) > 0]  # the written heads: unit RMS
    return {
        "ulps": max(_ulps(got_q, ref_q), _ulps(got_cache, ref_cache)),
        "relative": max(_relative(got_q, ref_q), _relative(got_cache, ref_cache)),
        "unequal": float((values != ref_cache[:, 1]).float().mean()),
        "rms": float(normed.float().pow(2).mean(-1).sqrt().sub(1).abs().max()),
    }


def interpreted() -> dict[str, dict]:
    as_the_gpu_does()
    out = {}
    for case in CASES:
        kernel, rows, width, dtype = case.split("-")
        out[case] = _one(kernel, int(rows), int(width), DTYPES[dtype])
    return out


@pytest.fixture(scope="module")
def findings() -> dict[str, dict]:
    return run_interpreted(__name__)


@pytest.mark.parametrize("case", CASES)
def test_stream_kernels_match_the_torch_ops_in_the_interpreter(findings, case):
    found = findings[case]
    bfloat16 = case.endswith("bfloat16")
    if case.startswith(("gated_gemv", "act_mul", "gemv")):  # against float32 math over the same inputs
        assert found["kernel"] <= (found["torch"] if bfloat16 else 1e-5), found
    elif case.startswith("rope_v_norm"):
        # values normed and rounded where the torch op rounds them (bit for bit in bfloat16);
        # rotated keys and queries within the kernel's float32 rotation of the bfloat16 products
        assert found["rms"] <= 1e-2 and found["relative"] <= (1e-2 if bfloat16 else 1e-5), found
        assert found["unequal"] == 0.0 or not bfloat16, found
    elif bfloat16:
        assert found["ulps"] <= 1 and found["unequal"] <= 0.02, found
    else:
        assert found["relative"] <= 1e-5, found


if __name__ == "__main__":
    print(json.dumps(interpreted()))
