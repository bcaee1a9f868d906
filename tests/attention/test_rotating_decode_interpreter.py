"""The split-KV decode that rotates its own query and writes the new K and V (one kernel for RoPE
and attention in a decode step) on the CPU through Triton's interpreter, against the torch path
it replaces: the torch RoPE op (q/k norms, V norm) writing the cache, then the float32 reference
attention over that cache.

Cases cover GQA ratios 1 to 4, 64- and 128-dim heads with a partial rotary width, pages of 16 and
32, a sliding window, Qwen-style and Gemma-style q/k norms, Gemma 4's value norm, an FP8 cache
with K and V scales, and a layer reading KV another layer wrote (no new K and V); rows from one
token (only the new key) to several slices. The output agrees with the reference to float32
noise in float32 and within 1e-2 relative in bfloat16 (the kernel rotates in float32 where the
torch op rotates in the model's dtype); the cache equals the torch op's, the written values bit
for bit in bfloat16, keys within that rotation's rounding; nothing else in the cache changes,
and the in-kernel merge's counters are back at zero.
Skipped where triton is not installed; the kernels run in a child process (the interpreter is
chosen as Triton is imported), which prints its findings when run as a module.
"""

import dataclasses
import json

import pytest
import torch

from attention.kernels import reference
from attention.kernels.calls import DecodeCall, NewKV, Rotary
from attention.kv_pool import FP8_E4M3, quantize
from tests.attention.paged import random_paged_kv
from tests.triton_interpreter import as_the_gpu_does
from tests.triton_interpreter import interpreter_findings as run_interpreted
from workers.models.layers import rope_cache
from workers.models.ops import TORCH_OPS

EPS = 1e-6
LENS = [1, 37, 150]
KV_HEADS = 2
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# name: (head dim, rotary width, group, page, window_left, norms, v norm, FP8 scales, writes K/V)
CASES = {
    "qwen-norms": (64, 64, 4, 16, -1, "qwen", False, None, True),
    "partial-window": (128, 64, 2, 32, 31, None, False, None, True),
    "gemma4-v-norm": (64, 64, 1, 16, -1, "gemma", True, None, True),
    "fp8": (64, 64, 4, 16, 63, None, False, (0.5, 2.0), True),
    "reads-shared-kv": (64, 64, 4, 16, -1, "gemma", False, None, False),
}
IDS = [f"{name}-{dtype}" for name in CASES for dtype in DTYPES if not (name == "fp8" and dtype == "float32")]


def _relative(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def compare(
    geometry: tuple, dtype: torch.dtype, device: str = "cpu", lens: list[int] = LENS, table_tokens: int = 0
) -> dict:
    """The rotating decode against RoPE then reference attention for one case's `geometry`
    (`CASES`' tuple): the differences the tests bound; tables padded to `table_tokens` (a
    captured graph's width)."""
    from attention.kernels import arrival, split_decode

    head_dim, rotary, group, page, window_left, norms_kind, v_norm, fp8, writes = geometry
    gen = torch.Generator().manual_seed(head_dim + group + page)
    q_heads, rows = KV_HEADS * group, len(lens)
    cache, tables, _ = random_paged_kv(lens, page, KV_HEADS, head_dim, torch.float32, seed=head_dim + group)
    tables = torch.nn.functional.pad(tables, (0, max(0, table_tokens // page - tables.shape[1])))
    k_scale, v_scale = fp8 or (1.0, 1.0)
    if fp8:
        cache = torch.stack([quantize(cache[:, 0], k_scale, FP8_E4M3), quantize(cache[:, 1], v_scale, FP8_E4M3)], 1)
    else:
        cache = cache.to(dtype)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary, 2).float() / rotary))
    cos_sin = rope_cache(inv_freq, 1.0, max(lens))
    lens = torch.tensor(lens, dtype=torch.int32)
    positions = lens.long() - 1
    last = positions
    slots = tables[torch.arange(rows), last // page].long() * page + last % page
    width = (q_heads + 2 * KV_HEADS) * head_dim
    qkv = torch.randn(rows, width, generator=gen).to(dtype).to(device)
    q = qkv[:, : q_heads * head_dim].view(rows, q_heads, head_dim)
    k = qkv[:, q_heads * head_dim : (q_heads + KV_HEADS) * head_dim].view(rows, KV_HEADS, head_dim)
    v = qkv[:, (q_heads + KV_HEADS) * head_dim :].view(rows, KV_HEADS, head_dim)
    norms = None
    if norms_kind:
        weights = (
            (torch.randn(head_dim, generator=gen) * 0.3).to(dtype),
            (torch.randn(head_dim, generator=gen)).to(dtype),
        )
        norms = (*(w.to(device) for w in weights), EPS, norms_kind == "gemma")
    v_eps = EPS if v_norm else None
    cache, tables, lens, positions, slots, cos_sin = (
        t.to(device) for t in (cache, tables, lens, positions, slots, cos_sin)
    )
    ref_cache, got_cache = cache.clone(), cache.clone()
    kv = (ref_cache, slots, v, (k_scale, v_scale)) if writes else None
    ref_q, _ = TORCH_OPS.rope(positions, q, k if writes else None, cos_sin, norms, kv, v_eps)
    call = DecodeCall(
        query=q,
        kv_cache=got_cache,
        block_tables=tables,
        seq_lens=lens,
        bmm1_scale=head_dim**-0.5,
        window_left=window_left,
        sinks=None,
        where="DECODE test",
        max_seq_len=tables.shape[1] * page,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    new_kv = NewKV(k, v, slots) if writes else None
    got = split_decode.decode_rotating(call, Rotary(positions, cos_sin, norms, v_eps), new_kv)
    ref = reference.decode(
        dataclasses.replace(call, query=ref_q.float(), kv_cache=ref_cache if fp8 else ref_cache.float())
    )
    written = torch.zeros(got_cache.shape[0] * page, dtype=torch.bool, device=device)
    written[slots] = writes
    untouched = ~written.view(-1, page)[:, None, None, :, None].expand_as(got_cache)
    values_ref, values_got = ref_cache[:, 1].float(), got_cache[:, 1].float()
    return {
        "out": _relative(got, ref),
        "keys": _relative(got_cache[:, 0].float(), ref_cache[:, 0].float()),
        "values_unequal": float((values_got != values_ref).float().mean()),
        "untouched_changed": float((got_cache.float() != cache.float())[untouched].float().sum()),
        "counters": int(arrival.counters(q.device, 1).abs().sum()),
    }


def interpreted() -> dict[str, dict]:
    as_the_gpu_does()
    out = {}
    for case in IDS:
        name, dtype = case.rsplit("-", 1)
        out[case] = compare(CASES[name], DTYPES[dtype])
    return out


@pytest.fixture(scope="module")
def findings() -> dict[str, dict]:
    return run_interpreted(__name__)


@pytest.mark.parametrize("case", IDS)
def test_rotating_decode_matches_rope_then_attention(findings, case):
    found = findings[case]
    bound = 1e-5 if case.endswith("float32") else 1e-2
    assert found["out"] <= bound and found["keys"] <= bound, found
    assert found["values_unequal"] == 0.0 or case.endswith("float32"), found
    assert found["untouched_changed"] == 0 and found["counters"] == 0, found


if __name__ == "__main__":
    print(json.dumps(interpreted()))
