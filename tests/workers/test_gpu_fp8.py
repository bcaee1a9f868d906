"""FP8 weights on CUDA against the float32 oracle (docs/design.md §4.9), at Llama-3-8B's projection
shapes, a scale per output channel and 128 x 128 blocks:

- the GEMV family (1 to 8 rows: batch 1 and 8) reads the FP8 weights with bf16 activations: within
  bf16 noise of the float32 product of the dequantised weights;
- W8A8 (batch 64, a 509-token prefill) quantises the activations per token (or per token and 128
  columns): within bf16 noise of the same product with the activations quantised as the format
  says, and within e4m3's rounding of the plain oracle;
- the fused gate/up GEMV, the dispatch through the op set, and a decode step of an FP8 engine
  under CUDA graphs with no host synchronisation inside it.
"""

import pytest
import torch

from workers.models import fp8
from workers.models.ops import FLASHINFER_OPS, TORCH_OPS

pytestmark = pytest.mark.gpu
SHAPES = {  # Llama-3-8B: (out, in)
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
}
ROWS = {"batch 1": 1, "batch 8": 8, "batch 64": 64, "prefill": 509}  # a prefill of no round size
LAYOUTS = {"channel": None, "block": (128, 128)}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _weights(shape: tuple[int, int], block, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return fp8.quantize(torch.randn(shape, device="cuda", generator=g) * 0.02, block)


def _activations(rows: int, k: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(rows, k, device="cuda", generator=g).bfloat16()


def _quantized_like_w8a8(x: torch.Tensor, group: int) -> torch.Tensor:
    """x as the W8A8 path sees it: e4m3 times a scale per token (group 0) or per token and
    `group` columns, float32."""
    xf = x.float()
    parts = xf.view(xf.shape[0], -1, group) if group else xf.view(xf.shape[0], 1, -1)
    scale = parts.abs().amax(dim=-1, keepdim=True).clamp(min=fp8.TINY) / 448.0
    return ((parts / scale).clamp(-448.0, 448.0).to(fp8.FP8).float() * scale).view_as(xf)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("rows", sorted(ROWS, key=ROWS.get))
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_fp8_products_match_the_float32_oracle(shape, rows, layout):
    from workers.models import fp8_gemv, fp8_matmul  # Triton: CUDA builds of torch only

    block, m = LAYOUTS[layout], ROWS[rows]
    w, s = _weights(SHAPES[shape], block)
    x = _activations(m, w.shape[1])
    oracle = TORCH_OPS.fp8_linear(x.float(), w, s, block, None)
    got = FLASHINFER_OPS.fp8_linear(x, w, s, block, None)
    assert got.dtype == torch.bfloat16 and got.shape == oracle.shape
    if m <= 8:
        assert fp8_gemv.applies(x, w, block)
        assert _rel(got, oracle) < 1e-2, f"{shape} {rows} {layout}: GEMV"
    else:
        assert fp8_matmul.w8a8_applies(x, w, block), "the 8B shapes take the scaled GEMM on Hopper"
        emulated = torch.nn.functional.linear(_quantized_like_w8a8(x, 128 if block else 0), fp8.dequantize(w, s, block))
        assert _rel(got, emulated) < 1e-2, f"{shape} {rows} {layout}: W8A8 against its emulation"
        assert _rel(got, oracle) < 6e-2, f"{shape} {rows} {layout}: W8A8 within e4m3 rounding of the oracle"


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("rows", [1, 5, 8])
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_fused_fp8_gate_up_gemv_matches_the_oracle(layout, rows, act):
    block = LAYOUTS[layout]
    w, s = _weights(SHAPES["gate_up"], block, seed=2)
    x = _activations(rows, w.shape[1], seed=3)
    oracle = TORCH_OPS.fp8_linear_act_and_mul(x.float(), w, s, block, None, act)
    assert _rel(FLASHINFER_OPS.fp8_linear_act_and_mul(x, w, s, block, None, act), oracle) < 1e-2


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_fp8_gemv_takes_biases_odd_shapes_and_strided_rows(layout):
    """Bias, N off the tile's rows, K off its columns (per channel; blocks need whole 128s of
    K here), rows sliced from a wider tensor."""
    block = LAYOUTS[layout]
    n, k = (1000, 1664) if block else (1001, 1000)
    w, s = _weights((n, k), block, seed=4)
    b = torch.randn(n, device="cuda").bfloat16()
    for rows in (1, 3, 8):
        wide = _activations(rows, k + 8, seed=rows)
        x = wide[:, 3 : 3 + k]
        oracle = TORCH_OPS.fp8_linear(x.float(), w, s, block, b.float())
        assert _rel(FLASHINFER_OPS.fp8_linear(x, w, s, block, b), oracle) < 1e-2, rows


def test_an_fp8_decode_step_replays_without_host_synchronisation(tmp_path):
    """An FP8 engine (`quantization: fp8`, dummy weights) decodes under CUDA graphs at batches 1, 8
    and 64 with no host synchronisation inside a steady step, and its projections are FP8."""
    import json

    from ops.bench.decode_throughput import syncs_per_step
    from tests.hf_models import random_prompts
    from workers.engine import Engine

    config = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        vocab_size=4096,
        max_position_embeddings=2048,
        bos_token_id=None,
        eos_token_id=None,
    )
    (tmp_path / "config.json").write_text(json.dumps(config))
    engine = Engine(model=str(tmp_path), device="cuda", load_format="dummy", quantization="fp8", max_total_tokens=8192)
    assert engine.runner.model.model.layers[0].mlp.down_proj.weight.dtype == fp8.FP8
    for batch in (1, 8, 64):
        assert syncs_per_step(engine, random_prompts([32] * batch, vocab=4096, seed=batch)) == 0, batch
    engine.check_no_leak()
