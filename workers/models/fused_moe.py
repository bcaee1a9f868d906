"""The experts of a mixture of experts on CUDA: Triton kernels over the routed (token, expert)
pairs, the torch path of `workers/models/moe.py` their oracle (docs/design.md §4.8).

Two shapes of work, chosen by how many pairs a forward routes (`gemv_tiles.moe_path`, data):
- **Few pairs** (decode steps, small verifies): one program per (pair, block of outputs) reads
  its expert's weight rows and the pair's input row, GEMV-like. Only the chosen experts'
  weights are read, once per pair that chose them. Products accumulate in a tile of float32
  sums reduced once after the K loop, as the dense GEMV's (a reduction every K tile holds back
  the next tile's loads), and the kernels launch with PDL (`attention/kernels/launch.py`). The
  last of a token's pairs to finish a block of outputs adds the pairs' rows in top-k order and
  writes the token's output in the model's dtype (`attention/kernels/arrival.py`): no sum and
  cast kernels after the down projection.
- **Many pairs** (prefills, large batches): a grouped GEMM. The pairs are sorted by expert on
  the device and each expert's run padded to the tile height (`align_on_device`: ranks taken by
  atomic counts, then placed, two kernels where torch's sort takes about twenty); each program
  multiplies
  one tile of one expert's pairs with `tl.dot`, reading that expert's weights once per tile.
  The grid is the most tiles the pairs could fill, so its size depends only on the batch; tiles
  past the experts' runs exit at once.

Either way the gate/up projection and the activation are one kernel (`act(gate) * up`, the
family's activation by code, `ACTIVATIONS`) writing the intermediate rows in the model's dtype,
and the down projection a second, which adds the expert's bias and scales by the pair's routing
weight into float32 rows; each token's top-k rows are then summed. Nothing is read back to the
host and no shape depends on the routing, so CUDA graphs capture both paths. Float32 inputs
multiply in full precision (`tl.dot` would round them to TF32).

MXFP4 experts (`Mxfp4Experts`: 4-bit codes, a power-of-two scale per 32 inputs of a row) are read
as they are stored, a quarter of bf16's bytes, and decoded exactly in registers (`_e2m1`,
`_e8m0`: a few integer operations a value, through float16's subnormals) before they multiply
(W4A16): the GEMV kernels take a byte's two inputs as its even and odd columns, the grouped GEMM
multiplies the even and odd halves of each K tile in two `tl.dot`s; from
`DEQUANTIZE_PAIRS_PER_EXPERT` (prefills) the experts are dequantised into a workspace first and
the bf16 GEMM runs.

Under expert parallelism (`expert_map`, as vLLM's) a rank holds some of the experts: a pair
routed to another rank's expert is skipped (its GEMV programs return, or write a zero row; the
grouped GEMM sorts it into a run of tiles that only zero its rows), so it costs no weight reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention.kernels.arrival import counters, last_arrival
from attention.kernels.launch import pdl_options, pdl_start, preloads
from workers.models.gemv_tiles import MOE_PATHS, moe_path, moe_tile_for, preload_width
from workers.models.moe import Activation
from workers.models.mxfp4 import Mxfp4Experts

ACTIVATIONS = {"gelu_pytorch_tanh": 0, "swiglu_clamped": 1, "silu": 2}  # the kernels' `ACT` codes
DEQUANT_ROWS, DEQUANT_COLS = 16, 256
GEMM_BLOCK_M, GEMM_BLOCK_N, GEMM_BLOCK_K = 64, 64, 64
ALIGN_BLOCK = 256  # pairs an `align_on_device` program ranks


@triton.jit
def _act(gate, up, ACT: tl.constexpr, alpha, limit):
    """`act(gate) * up` in float32: GELU-tanh (Gemma), clamped SwiGLU (gpt-oss), SiLU."""
    if ACT == 0:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        return 0.5 * gate * (1.0 + (2.0 * tl.sigmoid(2.0 * inner) - 1.0)) * up
    elif ACT == 1:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        return (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
    else:
        return gate * tl.sigmoid(gate) * up


@triton.jit
def _e2m1(pair):
    """(low nibble, high nibble) float32 values of the two E2M1 codes in each byte of `pair`
    (uint8) times 2^-14. Each code becomes float16 bits: its three magnitude bits at the top of
    the exponent and mantissa (exponent 0 is a subnormal there as in E2M1, so every value decodes
    exactly), its sign at bit 15. Both codes of a byte land in one 32-bit word, a float16 each
    half, with two multiplies (the byte's copies at bits 9 and 21 put each code's magnitude bits
    in place, at bits 12 and 24 each sign bit) and two masks; the halves then widen. A few
    integer operations a value: the decode must not outrun the bytes it saves (`kernel_sass`
    counts them)."""
    pair = pair.to(tl.uint32)
    word = ((pair * 0x200200) & 0x0E000E00) | ((pair * 0x1001000) & 0x80008000)
    return (
        word.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32),
        (word >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32),
    )


@triton.jit
def _e8m0(exponent):
    """2^(s - 127) in float32 from E8M0 scales s (uint8), times the 2^14 `_e2m1` leaves out
    (normal for every s up to 240; larger ones overflow, as no checkpoint's do)."""
    return ((exponent.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _mx_group_sums(x_row, w_rows, s_rows, k0, n_ok, K, BLOCK_K: tl.constexpr):
    """One K tile of a GEMV over MXFP4 rows (`w_rows`, `s_rows`: `[rows, 1]` pointers): `[rows,
    BLOCK_K / 32]` float32, per 32-input group the weights times x's inputs [k0, k0 + BLOCK_K),
    summed and then scaled (one scale a group, read once). A byte holds inputs 2i (low nibble)
    and 2i + 1; x is read in such pairs and split into its even and odd inputs."""
    GROUPS: tl.constexpr = BLOCK_K // 32
    g = tl.arange(0, GROUPS)
    byte = k0 // 2 + g[:, None] * 16 + tl.arange(0, 16)[None, :]  # [groups, 16]
    mask = n_ok[:, None, None] & (byte < K // 2)[None, :, :]  # (not 2 * byte < K: the loads stay vectors)
    codes = tl.load(w_rows[:, :, None] + byte[None, :, :], mask=mask, other=0, eviction_policy="evict_first")
    k = 2 * byte[:, :, None] + tl.arange(0, 2)[None, None, :]  # [groups, 16, 2]
    x_even, x_odd = tl.split(tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32))
    lo, hi = _e2m1(codes)
    sums = tl.sum(lo * x_even[None, :, :] + hi * x_odd[None, :, :], axis=2)
    groups_ok = n_ok[:, None] & (k0 + 32 * g < K)[None, :]
    return sums * _e8m0(tl.load(s_rows + (k0 // 32 + g)[None, :], mask=groups_ok, other=0))


@triton.jit
def _mx_tiles(w_cols, s_cols, k0, K, n_ok, dtype: tl.constexpr, BLOCK_K: tl.constexpr):
    """One K tile of MXFP4 weights for `tl.dot` (`w_cols`, `s_cols`: `[1, cols]` pointers), as
    (even inputs, odd inputs): `[BLOCK_K / 2, cols]` each in `dtype` (exact: two significant bits
    times a power of two); each group's scale read once and spread over its 16 bytes."""
    GROUPS: tl.constexpr = BLOCK_K // 32
    byte = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    codes = tl.load(w_cols + byte[:, None], mask=(byte < K // 2)[:, None] & n_ok[None, :], other=0)
    group = k0 // 32 + tl.arange(0, GROUPS)
    scales = _e8m0(tl.load(s_cols + group[:, None], mask=(group < K // 32)[:, None] & n_ok[None, :], other=0))
    cols: tl.constexpr = scales.shape[1]
    scale = tl.reshape(tl.broadcast_to(scales[:, None, :], (GROUPS, 16, cols)), (BLOCK_K // 2, cols))
    lo, hi = _e2m1(codes)
    return (lo * scale).to(dtype), (hi * scale).to(dtype)


@triton.jit
def _pair_inputs(rows, valid, k0, K, BLOCK_K: tl.constexpr):
    """One K tile of the grouped GEMM's input rows (`rows`: `[BLOCK_M, 1]` pointers) split as the
    MXFP4 codes are, (even inputs, odd inputs), `[BLOCK_M, BLOCK_K / 2]` each; masked by byte,
    so that the loads stay vectors."""
    byte = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    mask = valid[:, None] & (byte < K // 2)[None, :]
    return tl.load(rows + 2 * byte[None, :], mask=mask, other=0.0), tl.load(
        rows + 2 * byte[None, :] + 1, mask=mask, other=0.0
    )


@triton.jit
def _expert_of(ids_ptr, map_ptr, p, HAS_MAP: tl.constexpr):
    """Pair p's expert among those this rank holds (-1: held elsewhere)."""
    e = tl.load(ids_ptr + p).to(tl.int64)
    if HAS_MAP:
        e = tl.load(map_ptr + e).to(tl.int64)
    return e


@triton.jit
def _gemv_gate_up(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    h_ptr,
    ids_ptr,
    map_ptr,
    top_k,
    K,
    N,
    stride_x,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_be,
    stride_h,
    alpha,
    limit,
    HAS_BIAS: tl.constexpr,
    HAS_MAP: tl.constexpr,
    ACT: tl.constexpr,
    W4: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRELOAD_K: tl.constexpr,  # 0, or K rounded up: the row block read whole before the PDL wait
    PDL: tl.constexpr,
):
    """Program (p, n): outputs [n * BLOCK_N, +BLOCK_N) of `act(gate) * up` for pair p. The
    expert's gate rows are rows [0, N) of its `[2N, K]` weight, its up rows [N, 2N) (W4: MXFP4
    bytes `[2N, K / 2]`, scales `[2N, K / 32]` at `s_ptr`). With a map, a pair whose expert is
    elsewhere (-1) writes nothing. With PRELOAD_K the routing was written before the kernel
    before this one (`fused_experts`' `routed_early`), so the expert and its rows are read
    before the wait."""
    tl.static_assert(PRELOAD_K == 0 or not W4, "MXFP4 rows stream after the wait")
    if PRELOAD_K == 0:
        pdl_start(PDL)
    p = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    e = _expert_of(ids_ptr, map_ptr, p, HAS_MAP)
    if e < 0:
        return
    x_row = x_ptr + (p // top_k).to(tl.int64) * stride_x
    w_gate = w_ptr + e * stride_we + n[:, None].to(tl.int64) * stride_wn
    w_up = w_gate + N * stride_wn
    if PRELOAD_K > 0:
        k = tl.arange(0, PRELOAD_K)
        k_ok = k < K
        mask = n_ok[:, None] & k_ok[None, :]
        w_g = tl.load(w_gate + k[None, :], mask=mask, other=0.0)
        w_u = tl.load(w_up + k[None, :], mask=mask, other=0.0)
        pdl_start(PDL)
        x = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        tile_gate, tile_up = w_g.to(tl.float32) * x, w_u.to(tl.float32) * x
    elif W4:
        s_gate = s_ptr + e * stride_se + n[:, None].to(tl.int64) * stride_sn
        s_up = s_gate + N * stride_sn
        tile_gate = tl.zeros((BLOCK_N, BLOCK_K // 32), dtype=tl.float32)
        tile_up = tl.zeros((BLOCK_N, BLOCK_K // 32), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            tile_gate += _mx_group_sums(x_row, w_gate, s_gate, k0, n_ok, K, BLOCK_K)
            tile_up += _mx_group_sums(x_row, w_up, s_up, k0, n_ok, K, BLOCK_K)
    else:
        tile_gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        tile_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            x = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            mask = n_ok[:, None] & k_ok[None, :]
            w_g = tl.load(w_gate + k[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
            tile_gate += w_g.to(tl.float32) * x
            w_u = tl.load(w_up + k[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
            tile_up += w_u.to(tl.float32) * x
    acc_gate, acc_up = tl.sum(tile_gate, axis=1), tl.sum(tile_up, axis=1)
    if HAS_BIAS:
        acc_gate += tl.load(b_ptr + e * stride_be + n, mask=n_ok, other=0.0).to(tl.float32)
        acc_up += tl.load(b_ptr + e * stride_be + N + n, mask=n_ok, other=0.0).to(tl.float32)
    out = _act(acc_gate, acc_up, ACT, alpha, limit)
    tl.store(h_ptr + p.to(tl.int64) * stride_h + n, out.to(h_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _gemv_down(
    h_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    y_ptr,
    out_ptr,
    counter_ptr,
    ids_ptr,
    map_ptr,
    weights_ptr,
    top_k,
    K,
    N,
    stride_h,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_be,
    stride_y,
    HAS_BIAS: tl.constexpr,
    HAS_MAP: tl.constexpr,
    W4: tl.constexpr,
    TOP_K_PAD: tl.constexpr,  # top_k rounded up to a power of two
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRELOAD_K: tl.constexpr,  # 0, or K rounded up: the row block read whole before the PDL wait
    PDL: tl.constexpr,
):
    """Program (p, n): outputs [n * BLOCK_N, +BLOCK_N) of pair p's expert's down projection of
    its intermediate row, plus the expert's bias, times the pair's routing weight, into y
    (float32); the last of the token's pairs to arrive writes the token's sum of them to `out`
    in its dtype (W4: MXFP4 weights, as `_gemv_gate_up`'s). With a map, a pair whose expert is
    elsewhere (-1) adds zeros. With PRELOAD_K the expert, its rows and the routing weight are read
    before the wait: the routing was written before the gate/up kernel that this one waits for,
    which had waited for it (PDL launches this kernel after that wait)."""
    tl.static_assert(PRELOAD_K == 0 or not W4, "MXFP4 rows stream after the wait")
    if PRELOAD_K == 0:
        pdl_start(PDL)
    p = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    e = _expert_of(ids_ptr, map_ptr, p, HAS_MAP)
    h_row = h_ptr + p.to(tl.int64) * stride_h
    w_rows = w_ptr + e * stride_we + n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if PRELOAD_K > 0:
        k = tl.arange(0, PRELOAD_K)
        k_ok = k < K
        held = n_ok & (tl.zeros_like(n) + e >= 0)  # a vector: the interpreter takes no scalar mask term
        w = tl.load(w_rows + k[None, :], mask=held[:, None] & k_ok[None, :], other=0.0)
        routing = tl.load(weights_ptr + p)
        pdl_start(PDL)
        if e >= 0:
            h = tl.load(h_row + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            acc = tl.sum(w.to(tl.float32) * h, axis=1)
            if HAS_BIAS:
                acc += tl.load(b_ptr + e * stride_be + n, mask=n_ok, other=0.0).to(tl.float32)
            acc *= routing
    elif e >= 0:
        if W4:
            s_rows = s_ptr + e * stride_se + n[:, None].to(tl.int64) * stride_sn
            tile = tl.zeros((BLOCK_N, BLOCK_K // 32), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                tile += _mx_group_sums(h_row, w_rows, s_rows, k0, n_ok, K, BLOCK_K)
        else:
            tile = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                k_ok = k < K
                h = tl.load(h_row + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
                w = tl.load(
                    w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy="evict_first"
                )
                tile += w.to(tl.float32) * h
        acc = tl.sum(tile, axis=1)
        if HAS_BIAS:
            acc += tl.load(b_ptr + e * stride_be + n, mask=n_ok, other=0.0).to(tl.float32)
        acc *= tl.load(weights_ptr + p)
    tl.store(y_ptr + p.to(tl.int64) * stride_y + n, acc, mask=n_ok)
    token = p // top_k
    if last_arrival(counter_ptr + token * tl.num_programs(1) + tl.program_id(1), top_k):
        j = tl.arange(0, TOP_K_PAD)
        rows = y_ptr + (token * top_k + j).to(tl.int64)[:, None] * stride_y + n[None, :]
        parts = tl.load(rows, mask=(j < top_k)[:, None] & n_ok[None, :], other=0.0, cache_modifier=".cg")
        total = tl.sum(parts, axis=0)
        tl.store(out_ptr + token.to(tl.int64) * N + n, total.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _gemm_gate_up(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    h_ptr,
    pair_ptr,
    block_expert_ptr,
    num_pairs,
    num_experts,
    top_k,
    K,
    N,
    stride_x,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_be,
    stride_h,
    alpha,
    limit,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    W4: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program (m, n): tile m of the expert-sorted pairs (one expert's, `align_on_device`) times that
    expert's gate and up rows [n * BLOCK_N, +BLOCK_N), activated, into the pairs' rows of h (W4:
    MXFP4 weights, as `_gemv_gate_up`'s)."""
    e = tl.load(block_expert_ptr + tl.program_id(0)).to(tl.int64)
    if e >= num_experts:
        return
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pair_ptr + rows)
    valid = pairs < num_pairs
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    x_rows = x_ptr + (pairs // top_k).to(tl.int64)[:, None] * stride_x
    w_gate = w_ptr + e * stride_we + n[None, :].to(tl.int64) * stride_wn
    w_up = w_gate + N * stride_wn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if W4:
        s_gate = s_ptr + e * stride_se + n[None, :].to(tl.int64) * stride_sn
        s_up = s_gate + N * stride_sn
        for k0 in range(0, K, BLOCK_K):
            a_even, a_odd = _pair_inputs(x_rows, valid, k0, K, BLOCK_K)
            g_even, g_odd = _mx_tiles(w_gate, s_gate, k0, K, n_ok, a_even.dtype, BLOCK_K)
            u_even, u_odd = _mx_tiles(w_up, s_up, k0, K, n_ok, a_even.dtype, BLOCK_K)
            acc_gate = tl.dot(a_even, g_even, acc_gate, input_precision=PRECISION)
            acc_gate = tl.dot(a_odd, g_odd, acc_gate, input_precision=PRECISION)
            acc_up = tl.dot(a_even, u_even, acc_up, input_precision=PRECISION)
            acc_up = tl.dot(a_odd, u_odd, acc_up, input_precision=PRECISION)
    else:
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            a = tl.load(x_rows + k[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
            w_mask = k_ok[:, None] & n_ok[None, :]
            w_g = tl.load(w_gate + k[:, None], mask=w_mask, other=0.0)
            w_u = tl.load(w_up + k[:, None], mask=w_mask, other=0.0)
            acc_gate = tl.dot(a, w_g, acc_gate, input_precision=PRECISION)
            acc_up = tl.dot(a, w_u, acc_up, input_precision=PRECISION)
    if HAS_BIAS:
        acc_gate += tl.load(b_ptr + e * stride_be + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        acc_up += tl.load(b_ptr + e * stride_be + N + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = _act(acc_gate, acc_up, ACT, alpha, limit)
    h_rows = h_ptr + pairs.to(tl.int64)[:, None] * stride_h
    tl.store(h_rows + n[None, :], out.to(h_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _gemm_down(
    h_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    y_ptr,
    pair_ptr,
    block_expert_ptr,
    weights_ptr,
    num_pairs,
    num_experts,
    K,
    N,
    stride_h,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_be,
    stride_y,
    HAS_BIAS: tl.constexpr,
    HAS_MAP: tl.constexpr,
    W4: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program (m, n): tile m of the expert-sorted pairs' intermediate rows times that expert's
    down rows [n * BLOCK_N, +BLOCK_N), plus its bias, times each pair's routing weight. With a
    map, a tile past the experts' runs writes zero rows for the pairs in it (other ranks'). W4:
    MXFP4 weights, as `_gemv_gate_up`'s."""
    e = tl.load(block_expert_ptr + tl.program_id(0)).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    if e >= num_experts:
        if HAS_MAP:
            skipped = tl.load(pair_ptr + rows)
            y_skipped = y_ptr + skipped.to(tl.int64)[:, None] * stride_y
            zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            tl.store(y_skipped + n[None, :], zeros, mask=(skipped < num_pairs)[:, None] & n_ok[None, :])
        return
    pairs = tl.load(pair_ptr + rows)
    valid = pairs < num_pairs
    h_rows = h_ptr + pairs.to(tl.int64)[:, None] * stride_h
    w_cols = w_ptr + e * stride_we + n[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if W4:
        s_cols = s_ptr + e * stride_se + n[None, :].to(tl.int64) * stride_sn
        for k0 in range(0, K, BLOCK_K):
            a_even, a_odd = _pair_inputs(h_rows, valid, k0, K, BLOCK_K)
            w_even, w_odd = _mx_tiles(w_cols, s_cols, k0, K, n_ok, a_even.dtype, BLOCK_K)
            acc = tl.dot(a_even, w_even, acc, input_precision=PRECISION)
            acc = tl.dot(a_odd, w_odd, acc, input_precision=PRECISION)
    else:
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            a = tl.load(h_rows + k[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_cols + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + e * stride_be + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    acc *= tl.load(weights_ptr + pairs, mask=valid, other=0.0)[:, None]
    y_rows = y_ptr + pairs.to(tl.int64)[:, None] * stride_y
    tl.store(y_rows + n[None, :], acc, mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _dequantize_kernel(w_ptr, s_ptr, out_ptr, R, K, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (r, k): rows [r * BLOCK_R, +BLOCK_R) and inputs [k * BLOCK_K, +BLOCK_K) of MXFP4
    matrices stacked as `R` rows (codes `[R, K / 2]`, scales `[R, K / 32]`, both contiguous)
    into `out` `[R, K]` in its dtype."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    byte = tl.program_id(1) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    mask = (rows < R)[:, None] & (byte < K // 2)[None, :]
    codes = tl.load(w_ptr + rows.to(tl.int64)[:, None] * (K // 2) + byte[None, :], mask=mask, other=0)
    scale = _e8m0(tl.load(s_ptr + rows.to(tl.int64)[:, None] * (K // 32) + (byte // 16)[None, :], mask=mask))
    lo, hi = _e2m1(codes)
    values = tl.interleave(lo * scale, hi * scale)  # inputs 2i, 2i + 1
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    out = out_ptr + rows.to(tl.int64)[:, None] * K + k[None, :]
    tl.store(out, values.to(out_ptr.dtype.element_ty), mask=(rows < R)[:, None] & (k < K)[None, :])


def dequantize_experts(weights: Mxfp4Experts, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 experts `[E, out, in]` in `dtype`, on their device (exact in bf16 and float32)."""
    experts, out, width = weights.shape
    rows = experts * out
    dense = torch.empty(experts, out, width, dtype=dtype, device=weights.blocks.device)
    grid = (triton.cdiv(rows, DEQUANT_ROWS), triton.cdiv(width, DEQUANT_COLS))
    _dequantize_kernel[grid](
        weights.blocks.contiguous(), weights.scales.contiguous(), dense, rows, width, DEQUANT_ROWS, DEQUANT_COLS
    )
    return dense


def aligned_rows(pairs: int, runs: int, block_m: int) -> int:
    """The most rows `pairs` routed pairs in `runs` runs padded to `block_m` could fill: the
    aligned layout's size, a function of the pair count alone (graphs capture it)."""
    return min(pairs * block_m, triton.cdiv(pairs + runs * (block_m - 1), block_m) * block_m)


@triton.jit
def _run_of(ids_ptr, map_ptr, p, ok, E, HAS_MAP: tl.constexpr):
    """The run of pairs `p`: its expert, or with a map the rank-local expert (E where held elsewhere)."""
    e = tl.load(ids_ptr + p, mask=ok, other=0).to(tl.int32)
    if HAS_MAP:
        e = tl.load(map_ptr + e, mask=ok, other=0).to(tl.int32)
        e = tl.where(e >= 0, e, E)
    return e


@triton.jit
def _rank_kernel(
    ids_ptr,
    map_ptr,
    counts_ptr,  # runs + 1 zeroed counters: each run's pairs, then the programs' arrivals
    rank_ptr,
    starts_ptr,
    pair_of_row_ptr,
    block_expert_ptr,
    P,
    E,
    ROWS,
    HAS_MAP: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_RUNS: tl.constexpr,  # runs rounded up to a power of two
    BLOCK_T: tl.constexpr,
):
    """Program b: pairs [b * BLOCK, +BLOCK) take their ranks in their runs (an atomic count per
    run: the order within a run is arrival order, which no result depends on). The last program
    to arrive lays the runs out: each run's first row, the expert of every tile (`E` past the
    experts' runs), the filler in every row; it sets the counts back to zero."""
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = p < P
    e = _run_of(ids_ptr, map_ptr, p, ok, E, HAS_MAP)
    tl.store(rank_ptr + p, tl.atomic_add(counts_ptr + e, 1, mask=ok, sem="relaxed", scope="gpu"), mask=ok)
    runs = E
    if HAS_MAP:
        runs = E + 1
    if last_arrival(counts_ptr + runs, tl.num_programs(0)):
        r = tl.arange(0, BLOCK_RUNS)
        r_ok = r < runs
        count = tl.load(counts_ptr + r, mask=r_ok, other=0, cache_modifier=".cg")
        padded = (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = tl.cumsum(padded, 0)
        tl.store(starts_ptr + r, ends - padded, mask=r_ok)
        tl.store(counts_ptr + r, tl.zeros_like(count), mask=r_ok)
        expert_ends = tl.where(r < E, ends, ROWS + 1)  # the map's run counts as past the experts'
        for t0 in range(0, ROWS // BLOCK_M, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            expert = tl.sum((expert_ends[None, :] <= (t * BLOCK_M)[:, None]).to(tl.int32), axis=1)
            tl.store(block_expert_ptr + t, expert, mask=t < ROWS // BLOCK_M)
        for r0 in range(0, ROWS, BLOCK):
            rows = r0 + tl.arange(0, BLOCK)
            tl.store(pair_of_row_ptr + rows, tl.full((BLOCK,), P, tl.int32), mask=rows < ROWS)


@triton.jit
def _place_kernel(
    ids_ptr, map_ptr, rank_ptr, starts_ptr, pair_of_row_ptr, P, E, HAS_MAP: tl.constexpr, BLOCK: tl.constexpr
):
    """Program b: pairs [b * BLOCK, +BLOCK) into their rows (their run's first row plus their rank)."""
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = p < P
    e = _run_of(ids_ptr, map_ptr, p, ok, E, HAS_MAP)
    row = tl.load(starts_ptr + e, mask=ok, other=0) + tl.load(rank_ptr + p, mask=ok, other=0)
    tl.store(pair_of_row_ptr + row, p.to(tl.int32), mask=ok)


def align_on_device(
    ids: torch.Tensor, num_experts: int, block_m: int, expert_map: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair of each row `[R]`, expert of each tile `[R / block_m]`): the routed pairs (flattened
    `ids`) sorted by expert, each expert's run padded to a multiple of `block_m` with the pair
    count as filler, and tiles past the runs marked `num_experts`. With `expert_map`, pairs of
    experts held elsewhere (-1) form one more run, last, in tiles marked `num_experts`. `R` is
    `aligned_rows`; two kernels (ranks by atomic counts, then placement), no host read. A run's
    pairs are in arrival order: the grouped GEMM computes every row alike wherever it sits in
    its tile."""
    flat = ids.reshape(-1).contiguous()
    pairs, device = flat.numel(), flat.device
    runs = num_experts + (expert_map is not None)
    rows = aligned_rows(pairs, runs, block_m)
    pair_of_row = torch.empty(rows, dtype=torch.int32, device=device)
    block_expert = torch.empty(rows // block_m, dtype=torch.int32, device=device)
    rank = torch.empty(pairs, dtype=torch.int32, device=device)
    starts = torch.empty(runs, dtype=torch.int32, device=device)
    mapping = flat if expert_map is None else expert_map
    has_map = expert_map is not None
    grid = (triton.cdiv(pairs, ALIGN_BLOCK),)
    _rank_kernel[grid](
        flat, mapping, counters(device, runs + 1), rank, starts, pair_of_row, block_expert, pairs, num_experts, rows,
        HAS_MAP=has_map, BLOCK=ALIGN_BLOCK, BLOCK_M=block_m, BLOCK_RUNS=triton.next_power_of_2(runs), BLOCK_T=32,
    )  # fmt: skip
    _place_kernel[grid](
        flat, mapping, rank, starts, pair_of_row, pairs, num_experts, HAS_MAP=has_map, BLOCK=ALIGN_BLOCK
    )
    return pair_of_row, block_expert


def _operands(weights: torch.Tensor | Mxfp4Experts) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int, int]]:
    """(weights or MXFP4 blocks, scales (the weights again, never read, where not MXFP4), their
    expert and row strides)."""
    if isinstance(weights, Mxfp4Experts):
        w, s = weights.blocks, weights.scales
        return w, s, (w.stride(0), w.stride(1), s.stride(0), s.stride(1))
    return weights, weights, (weights.stride(0), weights.stride(1), 0, 0)


def fused_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor | Mxfp4Experts,
    down: torch.Tensor | Mxfp4Experts,
    weights: torch.Tensor,
    ids: torch.Tensor,
    act: Activation,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    path: str | None = None,
    routed_early: bool = False,
) -> torch.Tensor:
    """`experts_torch`'s result (same arguments) from the Triton kernels; `path` (of `MOE_PATHS`)
    forces a path (benchmarks, tests), else `moe_path` chooses. `routed_early`: `ids` and
    `weights` were written before the kernel that runs just before this call (a kernel between
    the router and the experts, one that waits for its predecessor before it lets the next
    launch, as this project's PDL kernels and flashinfer's do), so the gate/up GEMV may read
    the experts' rows before its PDL wait as the down GEMV always may."""
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    num_experts, width = gate_up.shape[0], gate_up.shape[1] // 2
    pairs = tokens * top_k
    if pairs == 0:
        return x.new_zeros(x.shape)
    x = x.contiguous()
    ids, weights = ids.reshape(-1).contiguous(), weights.reshape(-1).float().contiguous()
    h = torch.empty(pairs, width, dtype=x.dtype, device=x.device)
    y = torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)
    w4 = isinstance(gate_up, Mxfp4Experts)
    if w4 != isinstance(down, Mxfp4Experts):
        raise ValueError("gate_up and down: both MXFP4 or neither")
    path = path or moe_path(pairs, num_experts if expert_map is None else expert_map.numel(), w4)
    if path not in MOE_PATHS or (path == "dequant" and not w4):
        raise ValueError(f"path {path!r}: choose from {MOE_PATHS} ('dequant' for MXFP4 experts only)")
    gu_bias = x if gate_up_bias is None else gate_up_bias  # no bias: never read
    d_bias = x if down_bias is None else down_bias
    has_map = expert_map is not None
    mapping = ids if expert_map is None else expert_map  # no map: never read
    code = ACTIVATIONS[act.name]
    if path == "gemv":
        (gu_w, gu_s, gu_strides), (dn_w, dn_s, dn_strides) = _operands(gate_up), _operands(down)
        suffix = "_mxfp4" if w4 else ""
        up, dn = moe_tile_for("gate_up" + suffix, width), moe_tile_for("down" + suffix, width)
        up_blocks, down_blocks = triton.cdiv(width, up.rows), triton.cdiv(hidden, dn.rows)
        preload = preloads() and not w4
        up_preload = preload_width(up, hidden, 2) if preload and routed_early else 0
        _gemv_gate_up[(pairs, up_blocks)](
            x, gu_w, gu_s, gu_bias, h, ids, mapping, top_k, hidden, width,
            x.stride(0), *gu_strides, gu_bias.stride(0), h.stride(0), act.alpha, act.limit,
            HAS_BIAS=gate_up_bias is not None, HAS_MAP=has_map, ACT=code, W4=w4, BLOCK_N=up.rows, BLOCK_K=up.cols,
            PRELOAD_K=up_preload, num_warps=up.warps, **pdl_options(pairs * up_blocks),
        )  # fmt: skip
        out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
        _gemv_down[(pairs, down_blocks)](
            h, dn_w, dn_s, d_bias, y, out, counters(x.device, tokens * down_blocks), ids, mapping, weights, top_k,
            width, hidden, h.stride(0), *dn_strides, d_bias.stride(0), y.stride(0),
            HAS_BIAS=down_bias is not None, HAS_MAP=has_map, W4=w4, TOP_K_PAD=triton.next_power_of_2(top_k),
            BLOCK_N=dn.rows, BLOCK_K=dn.cols, PRELOAD_K=preload_width(dn, width, 1) if preload else 0,
            num_warps=dn.warps, **pdl_options(pairs * down_blocks),
        )  # fmt: skip
        return out
    dense = path == "dequant"  # the bf16 GEMM over each matrix dequantised in turn (one workspace)
    w4 = w4 and not dense
    bm, bn, bk = GEMM_BLOCK_M, GEMM_BLOCK_N, GEMM_BLOCK_K
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # float32 models: no TF32 rounding
    pair_of_row, block_expert = align_on_device(ids, num_experts, bm, expert_map)
    tiles = block_expert.shape[0]
    gu_w, gu_s, gu_strides = _operands(dequantize_experts(gate_up, x.dtype) if dense else gate_up)
    _gemm_gate_up[(tiles, triton.cdiv(width, bn))](
        x, gu_w, gu_s, gu_bias, h, pair_of_row, block_expert, pairs, num_experts, top_k, hidden, width,
        x.stride(0), *gu_strides, gu_bias.stride(0), h.stride(0), act.alpha, act.limit,
        HAS_BIAS=gate_up_bias is not None, ACT=code, W4=w4, PRECISION=precision, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
    )  # fmt: skip
    del gu_w, gu_s  # a dequantised workspace goes back before the next is taken
    dn_w, dn_s, dn_strides = _operands(dequantize_experts(down, x.dtype) if dense else down)
    _gemm_down[(tiles, triton.cdiv(hidden, bn))](
        h, dn_w, dn_s, d_bias, y, pair_of_row, block_expert, weights, pairs, num_experts, width, hidden,
        h.stride(0), *dn_strides, d_bias.stride(0), y.stride(0),
        HAS_BIAS=down_bias is not None, HAS_MAP=has_map, W4=w4, PRECISION=precision, BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_K=bk,
    )  # fmt: skip
    return y.view(tokens, top_k, hidden).sum(1).to(x.dtype)
