"""Few-row projections on CUDA: a Triton GEMV, and one fused with the gated activation.

A batch-1 decode step is a stream of weight reads. cuBLAS's kernels for a single row read the
weights of an 8B model's QKV and O projections at 60-77% of the device's copy rate and add
split-K reduce kernels; this kernel reads them 10-29% faster (`ops/bench/gemv_bandwidth.py`
measures both on the model shapes), and the fused variant writes `act(gate) * up` straight from the
merged gate/up weight, so the MLP's activation kernel and its round trip through memory go.
Each program owns `rows` output features and walks K in `cols`-wide tiles, accumulating in
float32; a tile with `splits` shares each row block's K between that many programs, the last to
finish adding up their partial sums (a projection with few outputs and long rows, Gemma-3-1B's
down projection, otherwise leaves most of the device idle). One row (a batch-1 decode or draft
step) is a dot product per output feature; two to `MAX_ROWS` rows (a batch-1 verify forward: the
draft's tokens and one more) go through `tl.dot` on a 16-row tile of x, so the weight is still
read once, where cuBLAS's few-row kernels read it at the one-row rate and add split-K reduces.
Wider inputs are matrix multiplications and stay on cuBLAS. Tiles by weight shape are data in
`gemv_tiles.py`. A one-row program whose whole row block fits its registers (Gemma-3-1B's QKV
and O projections) loads it before the PDL wait (`launch.py`): the weights arrive while the
kernel before still runs, and only x is read after it (about 2% of that model's batch-1 step).
A tile may unroll K (`Tile.unroll`; gate/up: K a multiple of its width; others: each split's
share): every tile's loads can then be issued before the first product, which Gemma-3-1B's
short rows need (gate/up 1.10x alone, 1.6% of its batch-1 step); the sums are the loop's, in
the same order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention.kernels.arrival import counters, last_arrival
from attention.kernels.launch import pdl_options, pdl_start, preloads
from workers.models.gemv_tiles import MAX_ROWS, PRELOAD_ELEMENTS, Tile, preload_width, tile_for
from workers.models.sandwich_norm import normed

DOT_ROWS = 16  # x's rows padded to tl.dot's smallest M

ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}  # the fused kernels' `ACT` codes


@triton.jit
def _weight_tile(w_ptrs, k0, cols, row_ok, K, EVEN_K: tl.constexpr):
    """One K tile of the weight rows (zeros past N and K)."""
    if EVEN_K:
        return tl.load(w_ptrs + k0, mask=row_ok[:, None], other=0.0, eviction_policy="evict_first")
    in_k = (k0 + cols) < K
    return tl.load(w_ptrs + k0, mask=row_ok[:, None] & in_k[None, :], other=0.0, eviction_policy="evict_first")


@triton.jit
def _product(w, x_ptr, k0, cols, K, EVEN_K: tl.constexpr):
    """A weight tile's products with x's inputs [k0, k0 + BLOCK_K), float32 (x zero past K)."""
    if EVEN_K:
        x = tl.load(x_ptr + k0 + cols)
    else:
        x = tl.load(x_ptr + k0 + cols, mask=(k0 + cols) < K, other=0.0)
    return w.to(tl.float32) * x.to(tl.float32)[None, :]


@triton.jit
def _tile(w_ptrs, x_ptr, k0, cols, row_ok, K, EVEN_K: tl.constexpr):
    """One K tile: the weight rows' products with x, float32 (masked past N and K)."""
    return _product(_weight_tile(w_ptrs, k0, cols, row_ok, K, EVEN_K), x_ptr, k0, cols, K, EVEN_K)


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    part_ptr,
    counter_ptr,
    N,
    K,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    K_SPLIT: tl.constexpr,  # K elements a split reads: a multiple of BLOCK_K
    PRELOAD_K: tl.constexpr,  # 0, or the whole row block's width (`preload_width`)
    UNROLL: tl.constexpr,  # the split's K tiles unrolled (EVEN_K: every split's K is inside K)
    PDL: tl.constexpr,
):
    block = tl.program_id(0)
    rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    if PRELOAD_K > 0:  # the weights before the wait (no kernel writes them), x after it
        ks = tl.arange(0, PRELOAD_K)
        in_k = ks < K
        w_ptrs = w_ptr + rows[:, None].to(tl.int64) * K + ks[None, :]
        w = tl.load(w_ptrs, mask=row_ok[:, None] & in_k[None, :], other=0.0)  # zeros past K: x's are too
        pdl_start(PDL)
        x = tl.load(x_ptr + ks, mask=in_k, other=0.0)
        y = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    else:
        pdl_start(PDL)
        cols = tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + rows[:, None].to(tl.int64) * K + cols[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        k_lo = tl.program_id(1) * K_SPLIT
        if UNROLL:  # tiles past K (the last split's) load nothing
            for i in tl.static_range(K_SPLIT // BLOCK_K):
                acc += _tile(w_ptrs, x_ptr, k_lo + i * BLOCK_K, cols, row_ok, K, EVEN_K)
        else:
            for k0 in range(k_lo, tl.minimum(k_lo + K_SPLIT, K), BLOCK_K):
                acc += _tile(w_ptrs, x_ptr, k0, cols, row_ok, K, EVEN_K)
        y = tl.sum(acc, axis=1)
    if SPLITS == 1:
        _store(y, b_ptr, y_ptr, rows, row_ok, HAS_BIAS)
    else:
        tl.store(part_ptr + tl.program_id(1) * N + rows, y, mask=row_ok)
        if last_arrival(counter_ptr + block, SPLITS):
            splits = tl.arange(0, SPLITS_PAD)
            parts = tl.load(
                part_ptr + splits[:, None] * N + rows[None, :],
                mask=(splits < SPLITS)[:, None] & row_ok[None, :],
                other=0.0,
                cache_modifier=".cg",  # written by other SMs
            )
            _store(tl.sum(parts, axis=0), b_ptr, y_ptr, rows, row_ok, HAS_BIAS)


@triton.jit
def _norm_gemv_kernel(
    h_ptr,
    res_ptr,
    before_ptr,
    norm_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    res_out_ptr,
    scale_ptr,
    N,
    K,
    eps,
    embed_scale,
    HAS_BEFORE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    NORM: tl.constexpr,  # the stream normed before the product (else projected as it is)
    GEMMA: tl.constexpr,
    EMBED: tl.constexpr,  # the stream starts here: h is the embedding table, res the token id
    BLOCK_N: tl.constexpr,
    WIDTH: tl.constexpr,  # `preload_width`: the whole row block is read before the wait
    PDL: tl.constexpr,
):
    """y = W . norm((res + before(h)) * scale) for one row, every program computing the row's
    norms itself (no norm kernel, no ticket); program 0 writes the new residual stream to
    `res_out` (the others still read `res`). With EMBED the stream is the token's embedding row
    times `embed_scale` (rounded as the model's dtype rounds it)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    ks = tl.arange(0, WIDTH)
    in_k = ks < K
    w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + ks[None, :], mask=row_ok[:, None] & in_k[None, :], other=0.0)
    if NORM:
        w_norm = tl.load(norm_ptr + ks, mask=in_k, other=0.0)
    if HAS_BEFORE:
        w_before = tl.load(before_ptr + ks, mask=in_k, other=0.0)
    dtype = y_ptr.dtype.element_ty
    pdl_start(PDL)
    if EMBED:
        token = tl.load(res_ptr).to(tl.int64)
        res = (tl.load(h_ptr + token * K + ks, mask=in_k, other=0.0).to(tl.float32) * embed_scale).to(dtype)
    else:
        h = tl.load(h_ptr + ks, mask=in_k, other=0.0)
        res = tl.load(res_ptr + ks, mask=in_k, other=0.0)
        if HAS_BEFORE:
            res += normed(h.to(tl.float32), w_before, in_k, eps, K, GEMMA, dtype)
        else:
            res += h
        if HAS_SCALE:
            res = (res.to(tl.float32) * tl.load(scale_ptr).to(dtype).to(tl.float32)).to(dtype)
    if tl.program_id(0) == 0:
        tl.store(res_out_ptr + ks, res, mask=in_k)
    if NORM:
        x = normed(res.to(tl.float32), w_norm, in_k, eps, K, GEMMA, dtype)
    else:
        x = res
    _store(tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1), b_ptr, y_ptr, rows, row_ok, HAS_BIAS)


@triton.jit
def _store(y, b_ptr, y_ptr, rows, row_ok, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _act(gate, ACT: tl.constexpr):
    if ACT == 0:  # SiLU
        return gate * tl.sigmoid(gate)
    # GELU, tanh approximation: tanh(u) = 2 sigmoid(2u) - 1
    inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
    return gate * tl.sigmoid(2.0 * inner)


@triton.jit
def _gemv_act_mul_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    N,
    K,
    ACT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    K_TILES: tl.constexpr,  # 0: a loop over K; else K == K_TILES * BLOCK_K, unrolled
    FIRST_EARLY: tl.constexpr,  # 1: the first K tile's weights read before the PDL wait (else 0)
    PDL: tl.constexpr,
):
    """y[j] = act(W[j] . x) * (W[N + j] . x): gate rows first, up rows after them; both tiles
    are read in the same iteration, so a program keeps two streams of loads in flight. Unrolled
    (`K_TILES`), every tile's loads can be issued before the first product needs them. With
    FIRST_EARLY the programs that launch while the kernel before still runs (the norm before an
    MLP is one program a row, so this kernel launches at once) have their first tiles on the way
    when the wait ends; no kernel writes weights."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    cols = tl.arange(0, BLOCK_K)
    gate_ptrs = w_ptr + rows[:, None].to(tl.int64) * K + cols[None, :]
    up_ptrs = gate_ptrs + N.to(tl.int64) * K
    if FIRST_EARLY:
        gate_first = _weight_tile(gate_ptrs, 0, cols, row_ok, K, EVEN_K)
        up_first = _weight_tile(up_ptrs, 0, cols, row_ok, K, EVEN_K)
        pdl_start(PDL)
        gate_acc = _product(gate_first, x_ptr, 0, cols, K, EVEN_K)
        up_acc = _product(up_first, x_ptr, 0, cols, K, EVEN_K)
    else:
        pdl_start(PDL)
        gate_acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        up_acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    if K_TILES > 0:
        for i in tl.static_range(FIRST_EARLY, K_TILES):
            gate_acc += _tile(gate_ptrs, x_ptr, i * BLOCK_K, cols, row_ok, K, True)
            up_acc += _tile(up_ptrs, x_ptr, i * BLOCK_K, cols, row_ok, K, True)
    else:
        for k0 in range(FIRST_EARLY * BLOCK_K, K, BLOCK_K):
            gate_acc += _tile(gate_ptrs, x_ptr, k0, cols, row_ok, K, EVEN_K)
            up_acc += _tile(up_ptrs, x_ptr, k0, cols, row_ok, K, EVEN_K)
    gate, up = tl.sum(gate_acc, axis=1), tl.sum(up_acc, axis=1)
    tl.store(y_ptr + rows, (_act(gate, ACT) * up).to(y_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _gated_gemv_kernel(
    gate_ptr,
    up_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    N,
    K,
    ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WIDTH: tl.constexpr,  # K rounded up to a power of two: the whole row block in registers
    PDL: tl.constexpr,
):
    """y = W . (act(gate) * up) for one short row: the weights read before the wait, the input
    computed by every program after it, rounded once to the dtype as the activation kernel
    rounds it (Gemma 4's per-layer input branch: no activation kernel, no concatenation)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    ks = tl.arange(0, WIDTH)
    in_k = ks < K
    w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + ks[None, :], mask=row_ok[:, None] & in_k[None, :], other=0.0)
    pdl_start(PDL)
    gate = tl.load(gate_ptr + ks, mask=in_k, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + ks, mask=in_k, other=0.0).to(tl.float32)
    x = (_act(gate, ACT) * up).to(y_ptr.dtype.element_ty).to(tl.float32)
    _store(tl.sum(w.to(tl.float32) * x[None, :], axis=1), b_ptr, y_ptr, rows, row_ok, HAS_BIAS)


@triton.jit
def _dot_tile(w_ptrs, x_tile, k0, cols, row_ok, K, acc, EVEN_K: tl.constexpr):
    if EVEN_K:
        w = tl.load(w_ptrs + k0, mask=row_ok[:, None], other=0.0, eviction_policy="evict_first")
    else:
        w = tl.load(
            w_ptrs + k0, mask=row_ok[:, None] & ((k0 + cols) < K)[None, :], other=0.0, eviction_policy="evict_first"
        )
    return tl.dot(x_tile, tl.trans(w), acc)


@triton.jit
def _rows_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,  # -1: a plain projection; else gate rows [0, N) and up rows [N, 2N) -> act(gate) * up
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """y[m, j] for every row m < M of x and the program's BLOCK_N output features: x's rows
    padded to BLOCK_M (masked loads), the weight tile read once for all of them."""
    pdl_start(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    ms = tl.arange(0, BLOCK_M)
    m_ok = ms < M
    cols = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + ms[:, None] * stride_xm + cols[None, :]
    w_ptrs = w_ptr + rows[:, None].to(tl.int64) * K + cols[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs + k0, mask=m_ok[:, None], other=0.0)
        else:
            x = tl.load(x_ptrs + k0, mask=m_ok[:, None] & ((k0 + cols) < K)[None, :], other=0.0)
        acc = _dot_tile(w_ptrs, x, k0, cols, row_ok, K, acc, EVEN_K)
        if ACT >= 0:
            up_acc = _dot_tile(w_ptrs + N.to(tl.int64) * K, x, k0, cols, row_ok, K, up_acc, EVEN_K)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
    if ACT >= 0:
        acc = _act(acc, ACT) * up_acc
    tl.store(
        y_ptr + ms[:, None] * N + rows[None, :], acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & row_ok[None, :]
    )


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """One to MAX_ROWS rows of unit stride along K against a contiguous half-precision weight of
    the same dtype, of a shape the tables give a tile."""
    return (
        x.is_cuda
        and 0 < x.numel() <= MAX_ROWS * x.shape[-1]
        and x.shape[-1] == weight.shape[1]
        and x.dtype == weight.dtype
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.is_contiguous()
        and x.stride(-1) == 1
        and tile_for(weight.shape[0], weight.shape[1], x.numel() // x.shape[-1]) is not None
    )


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, act: str | None, tile: Tile | None):
    """Both kernels, both variants: `n` output features of x's rows (`act`: from the merged
    `[gate; up]` weight, gate rows first); a tile's `rows` counts the weight rows a program reads."""
    k = weight.shape[1]
    n = weight.shape[0] // 2 if act else weight.shape[0]
    m = x.numel() // k
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    t = tile or tile_for(weight.shape[0], k, m)
    common = dict(BLOCK_K=t.cols, EVEN_K=k % t.cols == 0, num_warps=t.warps, num_stages=t.stages)
    if m > 1:
        block_n = max(DOT_ROWS, t.rows // 2) if act else t.rows
        x2 = x.reshape(m, k)
        grid = (triton.cdiv(n, block_n),)
        _rows_kernel[grid](
            x2,
            weight,
            bias if bias is not None else weight,
            y,
            m,
            n,
            k,
            x2.stride(0),
            HAS_BIAS=bias is not None,
            ACT=ACTIVATIONS[act] if act else -1,
            BLOCK_M=DOT_ROWS,
            BLOCK_N=block_n,
            **common,
            **pdl_options(grid[0]),
        )
    elif act:
        block_n = max(1, t.rows // 2)
        grid = (triton.cdiv(n, block_n),)
        k_tiles = k // t.cols if t.unroll and k % t.cols == 0 else 0
        _gemv_act_mul_kernel[grid](
            x, weight, y, n, k, ACT=ACTIVATIONS[act], BLOCK_N=block_n, K_TILES=k_tiles, FIRST_EARLY=int(preloads()),
            **common, **pdl_options(grid[0]),
        )  # fmt: skip
    else:
        blocks = triton.cdiv(n, t.rows)
        k_split = triton.cdiv(triton.cdiv(k, t.cols), t.splits) * t.cols
        preload = preload_width(t, k) if preloads() else 0
        unroll = t.unroll and not preload
        if unroll:  # unmasked only where the splits' K tiles cover K exactly (none starts past it)
            common["EVEN_K"] = t.splits * k_split == k
        part = torch.empty(t.splits, n, dtype=torch.float32, device=x.device) if t.splits > 1 else y
        _gemv_kernel[(blocks, t.splits)](
            x,
            weight,
            bias if bias is not None else weight,
            y,
            part,
            counters(x.device, blocks) if t.splits > 1 else y,
            n,
            k,
            HAS_BIAS=bias is not None,
            BLOCK_N=t.rows,
            SPLITS=t.splits,
            SPLITS_PAD=triton.next_power_of_2(t.splits),
            K_SPLIT=k_split,
            PRELOAD_K=preload,
            UNROLL=unroll,
            **common,
            **pdl_options(blocks * t.splits),
        )
    return y


def gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, tile: Tile | None = None
) -> torch.Tensor:
    """`x @ weight.T + bias` for one to MAX_ROWS rows (`applies(x, weight)`), shaped like
    F.linear's; `tile` overrides the table's (the benchmark's sweep)."""
    return _launch(x, weight, bias, None, tile)


def gemv_act_and_mul(x: torch.Tensor, weight: torch.Tensor, act: str, tile: Tile | None = None) -> torch.Tensor:
    """`act(gate) * up` from a merged `[gate; up]` weight (`act` in ACTIVATIONS), as `gemv`."""
    return _launch(x, weight, None, act, tile)


GATED_MAX_K = 1024  # the gated GEMV's longest row: its program holds a row block of K whole


def gated_applies(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `gated_gemv` takes this product: one row of gate and up, each of unit stride, no
    longer than GATED_MAX_K, against a contiguous half-precision weight of their dtype."""
    k = weight.shape[1]
    return (
        gate.is_cuda
        and gate.numel() == k == up.numel()
        and gate.shape[-1] == k == up.shape[-1]
        and k <= GATED_MAX_K
        and gate.dtype == up.dtype == weight.dtype
        and weight.dtype in (torch.bfloat16, torch.float16)
        and weight.is_contiguous()
        and gate.stride(-1) == 1 == up.stride(-1)
    )


def gated_gemv(
    gate: torch.Tensor, up: torch.Tensor, act: str, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`(act(gate) * up) @ weight.T + bias` for one row (`gated_applies`, `act` in ACTIVATIONS),
    shaped like F.linear's."""
    n, k = weight.shape
    width = triton.next_power_of_2(k)
    warps = 4
    block_n = max(1, min(16, PRELOAD_ELEMENTS * 32 * warps // width))
    y = torch.empty(*gate.shape[:-1], n, dtype=weight.dtype, device=weight.device)
    blocks = triton.cdiv(n, block_n)
    _gated_gemv_kernel[(blocks,)](
        gate,
        up,
        weight,
        bias if bias is not None else weight,
        y,
        n,
        k,
        ACT=ACTIVATIONS[act],
        HAS_BIAS=bias is not None,
        BLOCK_N=block_n,
        WIDTH=width,
        num_warps=warps,
        **pdl_options(blocks),
    )
    return y


def norm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `add_norm_gemv` takes this row: one row of a shape whose row block is read whole
    before the PDL wait (`preload_width`), preloads on."""
    if not (applies(x, weight) and x.numel() == x.shape[-1] and x.is_contiguous() and preloads()):
        return False
    return preload_width(tile_for(weight.shape[0], weight.shape[1]), weight.shape[1]) > 0


def add_norm_gemv(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm: torch.Tensor | None,
    eps: float,
    gemma: bool,
    before: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(W . rms_norm(s) + b, s) for one row (`norm_applies`), s = (residual + x') * scale, x' =
    rms_norm(x, before) (x without `before`; no scale: 1; no `norm`: W . s + b); the new
    residual in a new tensor."""
    out = torch.empty_like(residual)
    return _norm_gemv(x, residual, norm, eps, gemma, before, weight, bias, out, None, scale)


def embed_norm_gemv(
    token: torch.Tensor,
    table: torch.Tensor,
    scale: float,
    norm: torch.Tensor,
    eps: float,
    gemma: bool,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(W . rms_norm(e) + b, e) for one token id (`[1]`, int32 or int64), e = its row of `table`
    times `scale` (`norm_applies` of such a row): a decoder's first layer from the token."""
    stream = torch.empty(1, table.shape[1], dtype=table.dtype, device=table.device)
    rounded = float(torch.tensor(scale, dtype=table.dtype))  # as `ops.embed_rows` scales
    return _norm_gemv(table, token, norm, eps, gemma, None, weight, bias, stream, rounded)


def _norm_gemv(x, residual, norm, eps, gemma, before, weight, bias, res_out, embed_scale, scale=None):
    """The one launch behind `add_norm_gemv` (`embed_scale` None: x added to residual) and
    `embed_norm_gemv` (x the table, residual the token id, rows times `embed_scale`)."""
    k = weight.shape[1]
    t = tile_for(weight.shape[0], k)
    y = torch.empty(*res_out.shape[:-1], weight.shape[0], dtype=weight.dtype, device=weight.device)
    blocks = triton.cdiv(weight.shape[0], t.rows)
    _norm_gemv_kernel[(blocks,)](
        x,
        residual,
        before if before is not None else weight,
        norm if norm is not None else weight,
        weight,
        bias if bias is not None else weight,
        y,
        res_out,
        scale if scale is not None else weight,
        weight.shape[0],
        k,
        eps,
        1.0 if embed_scale is None else embed_scale,
        HAS_BEFORE=before is not None,
        HAS_BIAS=bias is not None,
        HAS_SCALE=scale is not None,
        NORM=norm is not None,
        GEMMA=gemma,
        EMBED=embed_scale is not None,
        BLOCK_N=t.rows,
        WIDTH=preload_width(t, k),
        num_warps=t.warps,
        **pdl_options(blocks),
    )
    return y, res_out
