"""Hopper kernels (XQA decode/verify, the split-KV Triton decode, FMHA-v2 context) against the
float32 reference kernels, bf16, on a GPU. Relative error ||out - ref|| / ||ref|| <= 1e-2.

Every pair of (page size, head dim, GQA ratio) values up to 256 dims is covered by a Latin
square; each row runs decode and one verify length (2..8), with and without a 127-token window.
Three more rows cover 512-dim heads (Gemma 4's full-attention layers).

With an FP8 (e4m3) cache (K scale 0.5, V scale 2: a kernel ignoring or swapping them is off by
far more than the bound) the reference reads the same FP8 values dequantised; XQA and FMHA-v2
compute in FP8 internally (FMHA-v2 quantises the query too), so their bound is FP8's rounding,
5e-2 (e4m3 keeps 3 mantissa bits: 2^-4 relative at worst per element, ~2% on average); the
split-KV kernel widens FP8 exactly and keeps bf16's 1e-2.
"""

import dataclasses

import pytest
import torch

from attention.kernels import KERNEL_SETS, ContextCall, DecodeCall, chain_mask, flashinfer_hopper, reference
from attention.kv_pool import FP8_E4M3, quantize
from attention.trtllm_mha import WORKSPACE_BYTES
from tests.attention import test_rotating_decode_interpreter as rotating
from tests.attention.paged import random_paged_kv

pytestmark = pytest.mark.gpu

# (page size, head dim, query heads per KV head)
COMBOS = [
    (16, 64, 1),
    (16, 128, 4),
    (16, 256, 8),
    (32, 64, 4),
    (32, 128, 8),
    (32, 256, 1),
    (64, 64, 8),
    (64, 128, 1),
    (64, 256, 4),
    (16, 512, 8),
    (64, 512, 1),
    (32, 512, 4),
]
COMBO_IDS = [f"page{p}-d{d}-group{g}" for p, d, g in COMBOS]
VERIFY_Q = [2, 3, 4, 5, 6, 7, 8, 3, 5, 5, 4, 2]
KV_HEADS = 2
MULTI_QUERY_MAX = KERNEL_SETS["sm90"].multi_query_max_head_dim
KV_LENS = [300, 1000, 131, 517]
FP8_SCALES = (0.5, 2.0)
FP8_COMBOS = [1, 2, 4, 6, 8, 9]  # every head dim and GQA ratio, both page sizes XQA and FMHA-v2 take
BOUND = {"bf16": 1e-2, "fp8": 5e-2}


@pytest.fixture(scope="module")
def workspace():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs a Hopper GPU")
    return torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all()
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _as_float32(call):
    """The call in float32 math: an FP8 cache stays as it is (the reference dequantises it)."""
    cache = call.kv_cache if call.kv_cache.dtype == FP8_E4M3 else call.kv_cache.float()
    return dataclasses.replace(call, query=call.query.float(), kv_cache=cache)


def _cache(kv: str, combo: int, lens: list[int], page: int, head_dim: int) -> tuple:
    """(cache, tables, scales) of random KV in bf16, or quantised to FP8 with `FP8_SCALES`."""
    cache, tables, _ = random_paged_kv(lens, page, KV_HEADS, head_dim, torch.bfloat16, "cuda", seed=combo)
    if kv == "bf16":
        return cache, tables, {}
    k_scale, v_scale = FP8_SCALES
    fp8 = torch.stack([quantize(cache[:, 0], k_scale, FP8_E4M3), quantize(cache[:, 1], v_scale, FP8_E4M3)], dim=1)
    return fp8, tables, {"k_scale": k_scale, "v_scale": v_scale}


def _kv_cases(combos: range) -> list:
    return [
        pytest.param(kv, combo, id=f"{kv}-{COMBO_IDS[combo]}")
        for kv in ("bf16", "fp8")
        for combo in combos
        if kv == "bf16" or combo in FP8_COMBOS
    ]


@pytest.mark.parametrize("window_left", [-1, 127])
@pytest.mark.parametrize("verify", [False, True])
@pytest.mark.parametrize("kv, combo", _kv_cases(range(len(COMBOS))))
def test_xqa_decode_and_verify(workspace, kv, combo, verify, window_left):
    page, head_dim, group = COMBOS[combo]
    if verify and head_dim > MULTI_QUERY_MAX:
        pytest.skip(f"XQA's multi-query mode refuses heads over {MULTI_QUERY_MAX}: such layers read one query a row")
    q_len = VERIFY_Q[combo] if verify else 1
    heads = KV_HEADS * group
    cache, tables, scales = _cache(kv, combo, KV_LENS, page, head_dim)
    g = torch.Generator(device="cuda").manual_seed(combo)
    sinks = torch.randn(heads, device="cuda", generator=g) if combo % 3 == 0 else None
    call = DecodeCall(
        query=torch.randn(len(KV_LENS) * q_len, heads, head_dim, device="cuda", generator=g).bfloat16(),
        kv_cache=cache,
        block_tables=tables,
        seq_lens=torch.tensor(KV_LENS, dtype=torch.int32, device="cuda"),
        bmm1_scale=head_dim**-0.5,
        window_left=window_left,
        sinks=sinks,
        where="TARGET_VERIFY test",
        max_seq_len=max(KV_LENS),
        q_len_per_req=q_len,
        mask=chain_mask(len(KV_LENS), q_len, torch.device("cuda")) if q_len > 1 else None,
        **scales,
    )
    call.check()
    out = flashinfer_hopper.decode(call, workspace)
    err = _rel_err(out, reference.decode(_as_float32(call)))
    print(
        f"xqa {kv} page={page} d={head_dim} group={group} q_len={q_len} window={window_left} "
        f"sinks={sinks is not None}: {err:.2e}"
    )
    assert err <= BOUND[kv]


@pytest.mark.parametrize("window_left", [-1, 127])
@pytest.mark.parametrize("kv, combo", _kv_cases(range(len(COMBOS))))
def test_split_decode(workspace, kv, combo, window_left):
    """One query a row over tables as wide as a captured graph's, rows of 1 token to past the
    window; the split count the kernel picks for this shape, a single split and more slices
    than the merge reads at a time; the counters of the in-kernel merge are back at zero."""
    from attention.kernels import arrival, split_decode

    page, head_dim, group = COMBOS[combo]
    lens = [1, *KV_LENS]
    heads = KV_HEADS * group
    cache, tables, scales = _cache(kv, combo, lens, page, head_dim)
    tables = torch.nn.functional.pad(tables, (0, 2048 // page - tables.shape[1]))
    g = torch.Generator(device="cuda").manual_seed(combo)
    call = DecodeCall(
        query=torch.randn(len(lens), heads, head_dim, device="cuda", generator=g).bfloat16(),
        kv_cache=cache,
        block_tables=tables,
        seq_lens=torch.tensor(lens, dtype=torch.int32, device="cuda"),
        bmm1_scale=head_dim**-0.5,
        window_left=window_left,
        sinks=torch.randn(heads, device="cuda", generator=g) if combo % 3 == 0 else None,
        where="DECODE test",
        max_seq_len=tables.shape[1] * page,
        **scales,
    )
    call.check()
    ref = reference.decode(_as_float32(call))
    for splits in (None, 1, 40):
        out = split_decode.decode(call, splits)
        err = _rel_err(out, ref)
        print(f"split {kv} page={page} d={head_dim} group={group} window={window_left} splits={splits}: {err:.2e}")
        assert err <= 1e-2
    assert int(arrival.counters(call.query.device, 1).abs().sum()) == 0


# the interpreter module's cases, and Gemma 4's and Llama-3-8B's geometries (head dim, rotary
# width, group, page, window_left, q/k norms, V norm, FP8 scales, writes K/V)
ROTATING = {
    **rotating.CASES,
    "gemma4-sliding": (256, 256, 4, 64, 511, "gemma", True, None, True),
    "gemma4-full-reads-shared": (512, 512, 4, 16, -1, "gemma", False, None, False),
    "gemma4-full-fp8": (512, 512, 8, 32, -1, "qwen", True, FP8_SCALES, True),
    "llama-fp8-page64": (128, 128, 4, 64, -1, None, False, FP8_SCALES, True),
}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", list(ROTATING))
def test_split_decode_rotating(workspace, name, dtype):
    """The split-KV decode rotating its own query and writing the new K and V against RoPE then
    the float32 reference (`test_rotating_decode_interpreter.compare`): rows of 1 to 1,000 keys
    over a captured graph's table width; written values bit for bit, the rest of the cache
    untouched, the merge's counters back at zero."""
    found = rotating.compare(ROTATING[name], getattr(torch, dtype), "cuda", [1, *KV_LENS], 2048)
    print(f"rotating {name} {dtype}: {found}")
    assert found["out"] <= 1e-2 and found["keys"] <= 1e-2, found
    assert found["values_unequal"] == 0.0 and found["untouched_changed"] == 0 and found["counters"] == 0, found


@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("window_left", [-1, 127])
@pytest.mark.parametrize("kv, combo", _kv_cases(range(len(COMBOS))))
def test_fmha_v2_context_with_cached_prefix(workspace, kv, combo, window_left, softcap):
    page, head_dim, group = COMBOS[combo]
    if head_dim > MULTI_QUERY_MAX:
        pytest.skip(f"FMHA-v2's outputs are wrong over {MULTI_QUERY_MAX} dims: such layers read one query a row")
    sinks_here = combo % 3 == 1
    if kv == "fp8" and softcap and sinks_here and not KERNEL_SETS["sm90"].fp8_kv_softcap_with_sinks:
        pytest.skip("FP8 FMHA-v2 is wrong with soft-capping and sinks together: refused at start-up")
    heads = KV_HEADS * group
    q_lens = [300, 17, 1, 64]  # a whole prompt, then chunks over cached prefixes
    cache, tables, scales = _cache(kv, combo, KV_LENS, page, head_dim)
    g = torch.Generator(device="cuda").manual_seed(100 + combo)
    sinks = torch.randn(heads, device="cuda", generator=g) if sinks_here else None
    cu = lambda xs: torch.tensor([0] + torch.tensor(xs).cumsum(0).tolist(), dtype=torch.int32, device="cuda")  # noqa: E731
    call = ContextCall(
        query=torch.randn(sum(q_lens), heads, head_dim, device="cuda", generator=g).bfloat16(),
        kv_cache=cache,
        block_tables=tables,
        seq_lens=torch.tensor(KV_LENS, dtype=torch.int32, device="cuda"),
        bmm1_scale=head_dim**-0.5,
        window_left=window_left,
        sinks=sinks,
        where="EXTEND test",
        cum_seq_lens_q=cu(q_lens),
        cum_seq_lens_kv=cu(KV_LENS),
        max_q_len=max(q_lens),
        max_kv_len=max(KV_LENS),
        logits_soft_cap=softcap,
        **scales,
    )
    call.check()
    out = flashinfer_hopper.context(call, workspace)
    err = _rel_err(out, reference.context(_as_float32(call)))
    print(
        f"fmha_v2 {kv} page={page} d={head_dim} group={group} window={window_left} softcap={softcap} "
        f"sinks={sinks is not None}: {err:.2e}"
    )
    assert err <= BOUND[kv]
