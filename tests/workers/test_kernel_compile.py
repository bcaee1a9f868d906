"""The Triton kernels the decode step runs, compiled for Hopper (sm_90) on any machine with
triton installed, no GPU needed: each variant the model code launches compiles, and none spills
registers to the stack (a spill turns a memory-bound GEMV's register tiles into local-memory
traffic). Pointers and sizes are compiled as divisible by 16 where Triton specialises them so at
launch for the models' shapes (`kernel_sass.launch_hints`). The resource counts come from the
cubin (`cuobjdump`, shipped with triton's CUDA backend). Skipped where triton is not installed
(CPU machines need not have it); where triton lacks the tool, only the compile is checked."""

import itertools
import re

import pytest

triton = pytest.importorskip("triton")

from triton.compiler import ASTSource  # noqa: E402

from ops.bench.kernel_sass import HOPPER, compiled, launch_hints, tool  # noqa: E402

# pointer types by argument name (others: *bf16 for a name ending in _ptr, i32 for the rest)
POINTERS = {
    "ids_ptr": "*i64",
    "map_ptr": "*i64",
    "pos_ptr": "*i64",
    "locs_ptr": "*i64",
    "cache_ptr": "*fp32",
    "y_ptr": "*fp32",
    "weights_ptr": "*fp32",
    "counter_ptr": "*i32",
    "buffers": "*i64",
    "state": "*i32",
    "q_out": "*bf16",
    "k_out": "*bf16",
    "cos_sin_ptr": "*fp32",
    "tables_ptr": "*i32",
    "lens_ptr": "*i32",
    "part_out_ptr": "*fp32",
    "part_lse_ptr": "*fp32",
    "sinks_ptr": "*fp32",
}
FLOATS = {
    "eps",
    "embed_scale",
    "alpha",
    "limit",
    "input_scale",
    "k_inv_scale",
    "v_inv_scale",
    "v_eps",
    "scale",
    "v_scale",
}


def _cases() -> list[tuple[str, str, str, dict, int]]:
    """(case id, module, kernel, constexprs, warps) as the model code launches them; the fused
    all-reduce's stack frame is not counted (it keeps one even without a norm, compiled as it is
    served), only its compile."""
    cases = []
    for scale, after, res_norm in itertools.product([False, True], repeat=3):
        if after and res_norm:  # a normed residual only in norm_add, which has no norm after
            continue
        flags = dict(GEMMA=False, HAS_SCALE=scale, AFTER=after, RES_NORM=res_norm, BLOCK=4096)
        cases.append(("sandwich_norm", "_norm_add_norm_kernel", flags, 16))
    for scale, norm in itertools.product([False, True], repeat=2):
        flags = dict(HAS_BEFORE=True, HAS_BIAS=False, HAS_SCALE=scale, NORM=norm, GEMMA=False, EMBED=False)
        cases.append(("gemv", "_norm_gemv_kernel", dict(flags, BLOCK_N=4, WIDTH=2048), 4))
        cases.append(("gemv", "_norm_gemv_kernel", dict(flags, BLOCK_N=4, WIDTH=4096), 8))  # Gemma-4-E4B's 8-warp tiles
    cases.append(("gemv", "_gated_gemv_kernel", dict(ACT=1, HAS_BIAS=False, BLOCK_N=16, WIDTH=256), 4))
    for first_early in (0, 1):  # the first weight tile read before the PDL wait, as on Hopper
        act_mul = dict(ACT=1, BLOCK_N=8, BLOCK_K=256, EVEN_K=True, K_TILES=0, FIRST_EARLY=first_early)
        cases.append(("gemv", "_gemv_act_mul_kernel", act_mul, 8))  # Gemma-4-E4B's gate/up at 8 warps
        unrolled = dict(ACT=0, BLOCK_N=4, BLOCK_K=128, EVEN_K=True, K_TILES=9, FIRST_EARLY=first_early)
        cases.append(("gemv", "_gemv_act_mul_kernel", unrolled, 8))  # Gemma-3-1B's, its K tiles unrolled
    one = dict(HAS_BIAS=False, BLOCK_N=4, SPLITS=1, SPLITS_PAD=1, PRELOAD_K=0)
    looped = dict(one, BLOCK_K=512, EVEN_K=True, K_SPLIT=10240, UNROLL=False)
    cases.append(("gemv", "_gemv_kernel", looped, 8))  # Gemma-4-E4B's down projection
    unrolled = dict(one, BLOCK_K=128, EVEN_K=True, K_SPLIT=6912, UNROLL=True)
    cases.append(("gemv", "_gemv_kernel", unrolled, 8))  # Gemma-3-1B's, its K tiles unrolled
    for v_norm in (False, True):
        dims = dict(HEAD_DIM=256, ROTARY=256, BLOCK_DIM=256)
        cases.append(("rope", "_rope_kernel", dict(dims, NORM=1, WRITE_KV=True, FP8=False, V_NORM=v_norm), 4))
    # the split-KV decode rotating its own query, with the tiles it launches: Gemma-4-E4B's
    # sliding and full layers (the latter reading KV another layer wrote) and Llama-3-8B's heads
    # over an FP8 cache
    from attention.kernels import split_decode

    for head_dim, writes, fp8 in ((256, True, False), (512, False, False), (128, True, True)):
        block_n, warps, _ = split_decode.rotating_tile(head_dim, fp8, writes)
        flags = dict(
            HAS_SINKS=False, PAGE=16, SPLITS=33, MERGE_CHUNK=min(32, split_decode.MERGE_ELEMENTS // (4 * head_dim))
        )
        flags.update(HEAD_DIM=head_dim, ROTARY=head_dim, GROUP=4, GROUP_PAD=16, GROUP_P2=4, BLOCK_N=block_n)
        flags.update(NORM=int(head_dim > 128), WRITE_KV=writes, V_NORM=head_dim > 128, FP8=fp8)
        cases.append(("attention.kernels.split_decode", "_rotating_slices_kernel", flags, warps))
    from workers.models import fused_router
    from workers.models.gemv_tiles import MOE_GEMV_TILES, moe_tile_for, preload_width

    for (_, tiles), has_map, w4 in itertools.product(MOE_GEMV_TILES, (False, True), (False, True)):
        suffix = "_mxfp4" if w4 else ""
        up, down = tiles["gate_up" + suffix], tiles["down" + suffix]
        flags = dict(HAS_BIAS=True, HAS_MAP=has_map, W4=w4)
        tile = dict(BLOCK_N=up.rows, BLOCK_K=up.cols)
        cases.append(("fused_moe", "_gemv_gate_up", dict(tile, **flags, ACT=1, PRELOAD_K=0), up.warps))
        tile = dict(BLOCK_N=down.rows, BLOCK_K=down.cols)
        cases.append(("fused_moe", "_gemv_down", dict(tile, **flags, TOP_K_PAD=8, PRELOAD_K=0), down.warps))
    # the row blocks read before the PDL wait: Gemma-4-26B-A4B's experts (704 x 2816)
    up, down = moe_tile_for("gate_up", 704), moe_tile_for("down", 704)
    bf16 = dict(HAS_BIAS=False, HAS_MAP=False, W4=False)
    tile = dict(BLOCK_N=up.rows, BLOCK_K=up.cols, PRELOAD_K=preload_width(up, 2816, 2))
    cases.append(("fused_moe", "_gemv_gate_up", dict(bf16, **tile, ACT=0), up.warps))
    tile = dict(BLOCK_N=down.rows, BLOCK_K=down.cols, PRELOAD_K=preload_width(down, 704, 1))
    cases.append(("fused_moe", "_gemv_down", dict(bf16, **tile, TOP_K_PAD=8), down.warps))

    for norm in (False, True):
        tile = dict(BLOCK_E=fused_router.BLOCK_E, BLOCK_K=fused_router.MAX_BLOCK_K, BLOCK_H=4096)
        for top_k in (0, 8):  # the logits alone; with the token's top-k in its last program
            routed = dict(TOP_K=top_k, HAS_SCALE=norm, BLOCK_EXPERTS=128)
            for preload in (False, True):
                flags = dict(tile, NORM=norm, HAS_BIAS=not norm, PRELOAD=preload, **routed)
                cases.append(("fused_router", "_logits_kernel", flags, 4))
    cases.append(("fused_router", "_top_k_kernel", dict(TOP_K=8, HAS_SCALE=True, BLOCK=128), 4))
    flags = dict(RANK=0, WORLD=2, NORM=True, GEMMA=False, BEFORE=True, BIAS=False, SCALE=True, BITS=16, BLOCK=8192)
    cases.append(("all_reduce_norm", "_all_reduce_add_rms_norm_kernel", flags, 16))
    return [(f"{m.rsplit('.', 1)[-1]}.{k}-{i}", m, k, {**c, "PDL": 2}, w) for i, (m, k, c, w) in enumerate(cases)]


CASES = _cases()


def _type(name: str, constexprs: dict) -> str:
    if constexprs.get("W4") and name in ("w_ptr", "s_ptr"):  # MXFP4 codes and scales
        return "*u8"
    if constexprs.get("FP8") and name == "kv_ptr":  # an FP8 cache
        return "*fp8e4nv"
    if name in POINTERS:
        return POINTERS[name]
    return "*bf16" if name.endswith("_ptr") else "fp32" if name in FLOATS else "i32"


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_kernel_compiles_for_hopper_without_spilling(case):
    import importlib

    _, module, name, constexprs, warps = case
    fn = getattr(importlib.import_module(module if "." in module else f"workers.models.{module}"), name)
    signature = {a: "constexpr" if a in constexprs else _type(a, constexprs) for a in fn.arg_names}
    if module == "all_reduce_norm" or tool() is None:
        triton.compile(ASTSource(fn, signature, constexprs), target=HOPPER, options={"num_warps": warps})
        return
    usage, _ = compiled(fn, signature, constexprs, warps, launch_hints(fn, constexprs))
    stack = re.search(r"STACK:(\d+)", usage)
    assert stack is not None and int(stack.group(1)) == 0, usage
