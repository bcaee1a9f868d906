"""Split-KV decode attention (flash-decoding) in Triton, for decode calls that leave most of the
GPU idle under XQA.

XQA's bf16 kernel gives one CTA a 256-token tile of one KV head, so a batch-1 decode over a
few KV heads runs on a handful of SMs and is bound by one CTA's load latency (Gemma-3-1B: one
KV head of 256 dims, ~30 us a layer). Here every (row, KV head) is split into `splits` slices
of its visible keys, each slice handled by its own program, and the program that finishes a
(row, KV head) last merges its slices' partial softmax results (log-sum-exp weighted, attention
sinks in the denominator; `arrival.py`): one kernel a call. Slices past a row's keys (a graph's
grid is sized for its table's width) store nothing and take no part in the merge.

It reads exactly a `DecodeCall`'s tensors: paged HND cache `[pages, 2, Hkv, page, D]` (the
query's dtype, or FP8 read with the call's K and V scales), page
tables, KV lengths (the query is the last position), `window_left` and sinks; one query a row
(decode and flat verify). The grid depends only on shapes, so a captured graph replays it for
any lengths up to its table's width.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from attention.kernels.arrival import counters, last_arrival
from attention.kernels.calls import DecodeCall, NewKV, Rotary, cdiv
from attention.kernels.launch import pdl_options, pdl_start
from attention.kernels.rotary import head_pairs, norm_weights, rotate, rotation, write_new_kv
from attention.kv_pool import FP8_E4M3

TARGET_PROGRAMS = 264  # two per SM of an H100/H200: enough slices to cover the device
WARPS, STAGES = 4, 3  # a program's warps and its key loop's pipeline depth
# an FP8 cache's (keys a block, warps, stages) at 128-dim heads and narrower (None: the bf16 tile):
# two stages read 64 rows of 4,096 tokens 1.29x faster than three on an H200
FP8_TILE: tuple[int, int, int] | None = (64, 4, 2)
MERGE_ELEMENTS = 16384  # partial-output floats the merge loads at a time (all slices of small calls)
# The kernel that rotates its own query holds its first block and the rotation's operands at
# once: writing the new K and V at 512 dims, blocks of 16 keys and eight warps, and eight warps
# over an FP8 cache (the tiles of `decode` spill registers there)


@triton.jit
def _slices_kernel(
    q_ptr,
    kv_ptr,
    tables_ptr,
    lens_ptr,
    part_out_ptr,
    part_lse_ptr,
    counter_ptr,
    sinks_ptr,
    out_ptr,
    scale,
    v_scale,
    window_left,
    stride_q_row,
    stride_q_head,
    stride_o_row,
    stride_o_head,
    stride_page,
    stride_kv,
    stride_head,
    stride_table,
    num_heads,
    kv_heads,
    HAS_SINKS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    GROUP_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,
    MERGE_CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len, active, lo, hi = _slice_bounds(lens_ptr, row, split, window_left, SPLITS, BLOCK_N)
    heads = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM)
    q_head = kv_head * GROUP + heads
    q = tl.load(
        q_ptr + row * stride_q_row + q_head[:, None] * stride_q_head + dims[None, :],
        mask=heads[:, None] < GROUP,
        other=0.0,
    )
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    denom = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    head_base = kv_ptr + kv_head * stride_head
    table = tables_ptr + row * stride_table
    for block in range(lo, hi, BLOCK_N):
        k, v, valid = _kv_block(
            head_base, table, block, hi, dims, stride_page, stride_kv, HEAD_DIM, PAGE, BLOCK_N, q.dtype
        )
        m, denom, acc = _online(q, k, v, valid, scale, m, denom, acc)
    _finish(
        m,
        denom,
        acc,
        v_scale,
        row,
        kv_head,
        split,
        active,
        part_out_ptr,
        part_lse_ptr,
        counter_ptr,
        sinks_ptr,
        out_ptr,
        stride_o_row,
        stride_o_head,
        num_heads,
        kv_heads,
        HAS_SINKS,
        GROUP,
        GROUP_PAD,
        GROUP_P2,
        HEAD_DIM,
        SPLITS,
        MERGE_CHUNK,
    )


@triton.jit
def _rotating_slices_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    cos_sin_ptr,
    q_norm_ptr,
    k_norm_ptr,
    eps,
    v_eps,
    locs_ptr,
    k_inv_scale,
    v_inv_scale,
    kv_ptr,
    tables_ptr,
    lens_ptr,
    part_out_ptr,
    part_lse_ptr,
    counter_ptr,
    sinks_ptr,
    out_ptr,
    scale,
    v_scale,
    window_left,
    stride_q_row,
    stride_q_head,
    stride_k_row,
    stride_k_head,
    stride_v_row,
    stride_v_head,
    stride_o_row,
    stride_o_head,
    stride_page,
    stride_kv,
    stride_head,
    stride_table,
    num_heads,
    kv_heads,
    HAS_SINKS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    GROUP_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROTARY: tl.constexpr,
    NORM: tl.constexpr,  # the per-head q/k norms (`rotary.rotated_heads`)
    WRITE_KV: tl.constexpr,  # the row's new key and value arrive here (else all keys are cached)
    V_NORM: tl.constexpr,
    FP8: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,
    MERGE_CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    """`_slices_kernel` over raw projections: each program rotates its query heads itself (no
    RoPE kernel), and the row's last slice writes the new token's K and V to the cache and
    takes them into its softmax from registers. No kernel before this one writes what a slice
    reads of the cache, so its first block is loaded before the PDL wait: the keys stream in
    while the projection before finishes, and only the projection's outputs are read after."""
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len, active, lo, hi = _slice_bounds(lens_ptr, row, split, window_left, SPLITS, BLOCK_N)
    cached_end = hi
    if WRITE_KV:
        cached_end = tl.minimum(hi, seq_len - 1)
    dtype = out_ptr.dtype.element_ty
    dims = tl.arange(0, HEAD_DIM)
    head_base = kv_ptr + kv_head * stride_head
    table = tables_ptr + row * stride_table
    k, v, valid = _kv_block(
        head_base, table, lo, cached_end, dims, stride_page, stride_kv, HEAD_DIM, PAGE, BLOCK_N, dtype
    )
    # what the rotations read besides the heads, and where the new K and V go: no kernel writes them
    pos = tl.load(pos_ptr + row).to(tl.int64)
    cos, sin = rotation(pos, cos_sin_ptr, ROTARY, HEAD_DIM)
    q_w, q_wq = norm_weights(q_norm_ptr, HEAD_DIM, ROTARY, HEAD_DIM, NORM)
    k_w, k_wq = norm_weights(k_norm_ptr, HEAD_DIM, ROTARY, HEAD_DIM, NORM)
    newest = WRITE_KV and split == active - 1  # this slice takes the row's new key and value
    loc = tl.load(locs_ptr + row, mask=newest, other=0).to(tl.int64)
    heads = tl.arange(0, GROUP_PAD)
    q_base = q_ptr + row * stride_q_row + (kv_head * GROUP + heads)[:, None] * stride_q_head
    newest_row = tl.full([1, 1], 1, tl.int1) & newest
    k_base = k_ptr + row * stride_k_row + kv_head * stride_k_head + tl.zeros([1, 1], tl.int32)
    v_base = v_ptr + row * stride_v_row + kv_head * stride_v_head + tl.zeros([1, 1], tl.int32)
    pdl_start(PDL)
    # the projection's outputs, all loads at once: the query heads, and the newest slice's key and value
    q_x, q_xq = head_pairs(q_base, heads[:, None] < GROUP, HEAD_DIM, ROTARY, HEAD_DIM)
    k_x, k_xq = head_pairs(k_base, newest_row, HEAD_DIM, ROTARY, HEAD_DIM)
    value = tl.load(v_base + dims[None, :], mask=newest_row, other=0.0)
    q = rotate(q_x, q_xq, cos, sin, q_w, q_wq, eps, HEAD_DIM, NORM, dtype)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    denom = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    if lo < cached_end:
        m, denom, acc = _online(q, k, v, valid, scale, m, denom, acc)
    for block in range(lo + BLOCK_N, cached_end, BLOCK_N):
        k, v, valid = _kv_block(
            head_base, table, block, cached_end, dims, stride_page, stride_kv, HEAD_DIM, PAGE, BLOCK_N, dtype
        )
        m, denom, acc = _online(q, k, v, valid, scale, m, denom, acc)
    if newest:
        key = rotate(k_x, k_xq, cos, sin, k_w, k_wq, eps, HEAD_DIM, NORM, dtype)
        dst = kv_ptr + (loc // PAGE) * stride_page + kv_head * stride_head + (loc % PAGE) * HEAD_DIM
        key, value = write_new_kv(
            dst, key, value, k_inv_scale, v_inv_scale, v_eps, stride_kv, HEAD_DIM, HEAD_DIM, V_NORM, FP8
        )
        # the newest key as one more column of scores, rounded as the blocks' products are
        score = tl.sum(q.to(tl.float32) * key.to(tl.float32), 1) * scale
        m_new = tl.maximum(m, score)
        alpha = tl.exp(m - m_new)
        p = tl.exp(score - m_new)
        denom = denom * alpha + p
        acc = acc * alpha[:, None] + p.to(dtype).to(tl.float32)[:, None] * value.to(tl.float32)
        m = m_new
    _finish(
        m,
        denom,
        acc,
        v_scale,
        row,
        kv_head,
        split,
        active,
        part_out_ptr,
        part_lse_ptr,
        counter_ptr,
        sinks_ptr,
        out_ptr,
        stride_o_row,
        stride_o_head,
        num_heads,
        kv_heads,
        HAS_SINKS,
        GROUP,
        GROUP_PAD,
        GROUP_P2,
        HEAD_DIM,
        SPLITS,
        MERGE_CHUNK,
    )


@triton.jit
def _slice_bounds(lens_ptr, row, split, window_left, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """(seq_len, active, lo, hi) of a row's slice: its visible keys [start, seq_len) cut into
    SPLITS slices of whole blocks; `active` counts the slices holding keys (one when none does):
    only these store partials and take tickets, the last of them merging; a graph's grid has
    slices for its table's width, a short request fills a few of them."""
    seq_len = tl.load(lens_ptr + row)
    start = 0
    if window_left >= 0:
        start = tl.maximum(seq_len - 1 - window_left, 0)
    per_split = tl.maximum(tl.cdiv(tl.cdiv(seq_len - start, SPLITS), BLOCK_N), 1) * BLOCK_N
    active = tl.maximum(tl.cdiv(seq_len - start, per_split), 1)
    lo = start + split * per_split
    return seq_len, active, lo, tl.minimum(lo + per_split, seq_len)


@triton.jit
def _kv_block(
    head_base,
    table_ptr,
    block,
    end,
    dims,
    stride_page,
    stride_kv,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    dtype: tl.constexpr,
):
    """Keys and values of tokens [block, block + BLOCK_N) before `end` (zeros after it), read
    through the row's page table and widened to `dtype` (an FP8 cache's entries exactly: its
    scales are folded into the scores' `scale` and the output's `v_scale`)."""
    tokens = block + tl.arange(0, BLOCK_N)
    valid = tokens < end
    pages = tl.load(table_ptr + tokens // PAGE, mask=valid, other=0)
    offs = pages.to(tl.int64)[:, None] * stride_page + ((tokens % PAGE) * HEAD_DIM)[:, None] + dims[None, :]
    k = tl.load(head_base + offs, mask=valid[:, None], other=0.0).to(dtype)
    v = tl.load(head_base + stride_kv + offs, mask=valid[:, None], other=0.0).to(dtype)
    return k, v, valid


@triton.jit
def _online(q, k, v, valid, scale, m, denom, acc):
    """One block of keys into the running softmax (max `m`, denominator, weighted values)."""
    scores = tl.dot(q, tl.trans(k)) * scale
    scores = tl.where(valid[None, :], scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, 1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(scores - m_new[:, None])
    denom = denom * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, denom, acc


@triton.jit
def _finish(
    m,
    denom,
    acc,
    v_scale,
    row,
    kv_head,
    split,
    active,
    part_out_ptr,
    part_lse_ptr,
    counter_ptr,
    sinks_ptr,
    out_ptr,
    stride_o_row,
    stride_o_head,
    num_heads,
    kv_heads,
    HAS_SINKS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    GROUP_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLITS: tl.constexpr,
    MERGE_CHUNK: tl.constexpr,
):
    """Store the slice's partial output and log-sum-exp; the group's last slice to arrive merges."""
    heads = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM)
    q_head = kv_head * GROUP + heads
    has = denom > 0
    out = tl.where(has[:, None], acc * v_scale / tl.where(has, denom, 1.0)[:, None], 0.0)
    lse = tl.where(has, m + tl.log(tl.where(has, denom, 1.0)), float("-inf"))
    slot = (row * num_heads + q_head) * SPLITS + split
    if split < active:
        keep = heads < GROUP
        tl.store(part_lse_ptr + slot, lse, mask=keep)
        tl.store(part_out_ptr + slot[:, None] * HEAD_DIM + dims[None, :], out, mask=keep[:, None])
        if last_arrival(counter_ptr + row * kv_heads + kv_head, active):
            first = kv_head * GROUP
            _merge_group(
                part_out_ptr,
                part_lse_ptr,
                (row * num_heads + first) * SPLITS,
                active,
                sinks_ptr + first,
                out_ptr + row * stride_o_row + first * stride_o_head,
                stride_o_head,
                HAS_SINKS,
                GROUP,
                GROUP_P2,
                HEAD_DIM,
                SPLITS,
                MERGE_CHUNK,
            )


@triton.jit
def _merge_group(
    part_out_ptr,
    part_lse_ptr,
    first_slot,
    active,
    sinks_ptr,
    out_ptr,
    stride_o_head,
    HAS_SINKS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLITS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """The group's query heads from the partials of their `active` slices, `CHUNK` slices of
    every head a load, rescaled online (read past L1: other SMs wrote them)."""
    heads = tl.arange(0, GROUP_P2)
    dims = tl.arange(0, HEAD_DIM)
    chunk = tl.arange(0, CHUNK)
    head_ok = heads < GROUP
    top = tl.full([GROUP_P2], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_P2], tl.float32)
    acc = tl.zeros([GROUP_P2, HEAD_DIM], tl.float32)
    for c in range(0, active, CHUNK):
        slots = first_slot + heads[:, None] * SPLITS + c + chunk[None, :]
        ok = head_ok[:, None] & (c + chunk < active)[None, :]
        lse = tl.load(part_lse_ptr + slots, mask=ok, other=float("-inf"), cache_modifier=".cg")
        parts = tl.load(
            part_out_ptr + slots[:, :, None] * HEAD_DIM + dims[None, None, :],
            mask=ok[:, :, None],
            other=0.0,
            cache_modifier=".cg",
        )
        new_top = tl.maximum(top, tl.max(lse, 1))
        base = tl.where(new_top == float("-inf"), 0.0, new_top)
        weights = tl.exp(lse - base[:, None])
        rescale = tl.exp(top - base)
        acc = acc * rescale[:, None] + tl.sum(weights[:, :, None] * parts, 1)
        total = total * rescale + tl.sum(weights, 1)
        top = new_top
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + heads, mask=head_ok, other=float("-inf"))
        new_top = tl.maximum(top, sink)
        base = tl.where(new_top == float("-inf"), 0.0, new_top)
        rescale = tl.exp(top - base)
        acc = acc * rescale[:, None]
        total = total * rescale + tl.exp(sink - base)
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(
        out_ptr + heads[:, None] * stride_o_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=head_ok[:, None],
    )


def num_splits(rows: int, kv_heads: int, table_tokens: int, block_n: int) -> int:
    """Slices a (row, KV head) gets: enough programs to cover the device, never more than the
    table holds blocks. A function of shapes only (graphs capture it)."""
    return max(1, min(cdiv(TARGET_PROGRAMS, rows * kv_heads), cdiv(table_tokens, block_n)))


def block_tokens(head_dim: int) -> int:
    return 64 if head_dim <= 128 else 32


def rotating_tile(head_dim: int, fp8: bool, writes: bool) -> tuple[int, int, int]:
    """(keys a block, warps, stages) of `decode_rotating`."""
    if writes and head_dim > 256:
        return 16, 8, STAGES
    if fp8 and FP8_TILE is not None:
        return FP8_TILE[0], 8, FP8_TILE[2]
    return block_tokens(head_dim), WARPS, STAGES


@dataclasses.dataclass
class _Launch:
    """What both kernels' launches share: the grid, the merge's buffers and the tile."""

    grid: tuple[int, int, int]
    part_out: torch.Tensor
    part_lse: torch.Tensor
    counters: torch.Tensor
    sinks: torch.Tensor
    out: torch.Tensor
    meta: dict


def _launch(call: DecodeCall, splits: int | None, tile: tuple[int, int, int] | None) -> _Launch:
    q, cache, tables = call.query, call.kv_cache, call.block_tables
    rows, num_heads, head_dim = q.shape
    kv_heads, page = cache.shape[2], cache.shape[3]
    if call.q_len_per_req != 1 or q.stride(2) != 1 or cache.stride(3) != head_dim or cache.stride(4) != 1:
        raise ValueError(
            f"{call.where}: split decode takes one query a row and dense heads, got q_len_per_req "
            f"{call.q_len_per_req}, query strides {q.stride()}, cache strides {cache.stride()}"
        )
    group = num_heads // kv_heads
    if tile is None and cache.element_size() == 1 and head_dim <= 128 and FP8_TILE is not None:
        tile = FP8_TILE
    block_n, warps, stages = tile or (block_tokens(head_dim), WARPS, STAGES)
    splits = splits or num_splits(rows, kv_heads, tables.shape[1] * page, block_n)
    part_lse = torch.empty(rows * num_heads * splits, dtype=torch.float32, device=q.device)
    return _Launch(
        grid=(rows, kv_heads, splits),
        part_out=torch.empty(rows * num_heads * splits, head_dim, dtype=torch.float32, device=q.device),
        part_lse=part_lse,
        counters=counters(q.device, rows * kv_heads),
        sinks=call.sinks if call.sinks is not None else part_lse,
        out=torch.empty(rows, num_heads, head_dim, dtype=q.dtype, device=q.device),
        meta=dict(
            HAS_SINKS=call.sinks is not None,
            GROUP=group,
            GROUP_PAD=max(16, triton.next_power_of_2(group)),
            GROUP_P2=triton.next_power_of_2(group),
            HEAD_DIM=head_dim,
            PAGE=page,
            BLOCK_N=block_n,
            SPLITS=splits,
            MERGE_CHUNK=min(
                triton.next_power_of_2(splits), max(1, MERGE_ELEMENTS // (triton.next_power_of_2(group) * head_dim))
            ),
            num_warps=warps,
            num_stages=stages,
            **pdl_options(rows * kv_heads * splits),
        ),
    )


def decode(call: DecodeCall, splits: int | None = None, tile: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Attention of one query a row; returns `[rows, H, D]` in the query's dtype. `splits`
    overrides the slice count (tests); `tile` the (keys a block, warps, stages) (the benchmark's
    sweep)."""
    q, cache, tables = call.query, call.kv_cache, call.block_tables
    run = _launch(call, splits, tile)
    _slices_kernel[run.grid](
        q,
        cache,
        tables,
        call.seq_lens,
        run.part_out,
        run.part_lse,
        run.counters,
        run.sinks,
        run.out,
        call.bmm1_scale * call.k_scale,
        call.v_scale,
        call.window_left,
        q.stride(0),
        q.stride(1),
        run.out.stride(0),
        run.out.stride(1),
        cache.stride(0),
        cache.stride(1),
        cache.stride(2),
        tables.stride(0),
        q.shape[1],
        cache.shape[2],
        **run.meta,
    )
    return run.out


def decode_rotating(
    call: DecodeCall,
    rotary: Rotary,
    new_kv: NewKV | None,
    splits: int | None = None,
    tile: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """`decode` of a decode step whose `call.query` holds the layer's raw (unrotated) query
    heads, any row and head strides: RoPE and the q/k norms as `rotary` says, and with `new_kv`
    each row's new key (raw) and value written to the cache at its slot (quantised with the
    call's scales into an FP8 cache) and attended as the row's last key; without it every key
    is in the cache already (a layer reading another's KV)."""
    q, cache, tables = call.query, call.kv_cache, call.block_tables
    run = _launch(call, splits, tile or rotating_tile(q.shape[-1], cache.dtype == FP8_E4M3, new_kv is not None))
    q_w, k_w, eps, gemma = rotary.norms or (q, None, 0.0, False)  # no norms: weights never read
    key, value, slots = new_kv or (q, q, rotary.positions)  # no new KV: never read
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError(f"{call.where}: the new key and value need unit stride along a head")
    _rotating_slices_kernel[run.grid](
        q,
        key,
        value,
        rotary.positions,
        rotary.cos_sin,
        q_w,
        q_w if k_w is None else k_w,
        eps,
        0.0 if rotary.v_norm_eps is None else rotary.v_norm_eps,
        slots,
        1.0 / call.k_scale,
        1.0 / call.v_scale,
        cache,
        tables,
        call.seq_lens,
        run.part_out,
        run.part_lse,
        run.counters,
        run.sinks,
        run.out,
        call.bmm1_scale * call.k_scale,
        call.v_scale,
        call.window_left,
        q.stride(0),
        q.stride(1),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        run.out.stride(0),
        run.out.stride(1),
        cache.stride(0),
        cache.stride(1),
        cache.stride(2),
        tables.stride(0),
        q.shape[1],
        cache.shape[2],
        ROTARY=rotary.cos_sin.shape[-1],
        NORM=0 if rotary.norms is None else 2 if gemma else 1,
        WRITE_KV=new_kv is not None,
        V_NORM=new_kv is not None and rotary.v_norm_eps is not None,
        FP8=cache.dtype == FP8_E4M3,
        **run.meta,
    )
    return run.out
