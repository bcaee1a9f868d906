"""A greedy decode step's tail on CUDA: the LM head's logits to float32 (soft-capped where the
model caps them) into the caller's buffer, and each row's argmax, in one Triton kernel.

As torch ops that is a cast, a copy into the graph's static logits and an argmax: three
launches, the argmax alone (one reduction over a 262,144-word vocabulary) about 8 us of a
Gemma-3-1B batch-1 step. Here each program converts a chunk of a row and finds the chunk's
first maximum; the last program of the row to arrive (`attention/kernels/arrival.py`) picks the
first index holding the row's maximum, as `torch.argmax` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from attention.kernels.arrival import counters, last_arrival
from attention.kernels.launch import pdl_options, pdl_start

CHUNK = 4096  # vocabulary entries a program


@triton.jit
def _logits_argmax_kernel(
    raw_ptr,
    out_ptr,
    tokens_ptr,
    part_max_ptr,
    part_idx_ptr,
    counter_ptr,
    vocab,
    cap,
    stride_raw,
    stride_out,
    CAPPED: tl.constexpr,
    CHUNK: tl.constexpr,
    CHUNKS: tl.constexpr,
    CHUNKS_P2: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = cols < vocab
    x = tl.load(raw_ptr + row.to(tl.int64) * stride_raw + cols, mask=mask, other=0.0).to(tl.float32)
    if CAPPED:
        x = libdevice.tanh(tl.math.div_rn(x, cap)) * cap  # rounded as torch divides
    tl.store(out_ptr + row.to(tl.int64) * stride_out + cols, x, mask=mask)
    x = tl.where(mask, x, float("-inf"))
    best = tl.max(x, 0)
    first = tl.min(tl.where(x == best, cols, vocab), 0)
    slot = row * CHUNKS + chunk
    tl.store(part_max_ptr + slot, best)
    tl.store(part_idx_ptr + slot, first)
    if last_arrival(counter_ptr + row, CHUNKS):
        chunks = tl.arange(0, CHUNKS_P2)
        ok = chunks < CHUNKS
        maxima = tl.load(part_max_ptr + row * CHUNKS + chunks, mask=ok, other=float("-inf"), cache_modifier=".cg")
        firsts = tl.load(part_idx_ptr + row * CHUNKS + chunks, mask=ok, other=vocab, cache_modifier=".cg")
        top = tl.max(maxima, 0)
        tl.store(tokens_ptr + row, tl.min(tl.where(maxima == top, firsts, vocab), 0).to(tl.int64))


def logits_argmax(raw: torch.Tensor, cap: float | None, out: torch.Tensor, tokens: torch.Tensor) -> None:
    """`out` (float32 `[n, V]`, unit column stride) = the logits `raw` `[n, V]` in float32,
    `cap * tanh(raw / cap)` with a cap; `tokens` (int64 `[n]`) = each row's argmax."""
    rows, vocab = raw.shape
    if raw.stride(1) != 1 or out.stride(1) != 1 or out.shape != raw.shape or out.dtype != torch.float32:
        raise ValueError(
            f"logits_argmax: logits {tuple(raw.shape)} strides {raw.stride()} into float32 rows of unit "
            f"stride, got {out.dtype} {tuple(out.shape)} strides {out.stride()}"
        )
    chunks = triton.cdiv(vocab, CHUNK)
    part_max = torch.empty(rows * chunks, dtype=torch.float32, device=raw.device)
    part_idx = torch.empty(rows * chunks, dtype=torch.int32, device=raw.device)
    _logits_argmax_kernel[(rows, chunks)](
        raw,
        out,
        tokens,
        part_max,
        part_idx,
        counters(raw.device, rows),
        vocab,
        float(cap or 1.0),
        raw.stride(0),
        out.stride(0),
        CAPPED=bool(cap),
        CHUNK=CHUNK,
        CHUNKS=chunks,
        CHUNKS_P2=triton.next_power_of_2(chunks),
        num_warps=4,
        **pdl_options(rows * chunks),
    )
