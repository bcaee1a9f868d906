"""Hopper (SM90) kernels through flashinfer: XQA for decode and verify, FMHA-v2 for context.

Both are JIT-compiled by flashinfer on first use (XQA ~10 s per variant, FMHA-v2 ~150 s per
variant) and cached under ~/.cache/flashinfer.

An FP8 (e4m3) cache: XQA reads it beside a query in the model's dtype, its K scale folded into
`bmm1_scale` and its V scale passed as `bmm2_scale`. FMHA-v2 takes an FP8 cache only with an FP8
query (one dtype for Q and KV), so the query is quantised too, with scale 1 (as vLLM's default
q_scale) and saturated to e4m3's range; the output stays in the model's dtype.
"""

from __future__ import annotations

import torch

from attention.kernels.calls import ContextCall, DecodeCall
from attention.kv_pool import FP8_E4M3, quantize


def decode(call: DecodeCall, workspace: torch.Tensor) -> torch.Tensor:
    import flashinfer

    return flashinfer.decode.trtllm_batch_decode_with_kv_cache(
        query=call.query,
        kv_cache=call.kv_cache,
        workspace_buffer=workspace,
        block_tables=call.block_tables,
        seq_lens=call.seq_lens,
        max_seq_len=call.max_seq_len,
        bmm1_scale=call.bmm1_scale * call.k_scale,
        bmm2_scale=call.v_scale,
        window_left=call.window_left,
        sinks=call.sinks,
        out_dtype=call.query.dtype,
        kv_layout="HND",
        backend="xqa",
        q_len_per_req=call.q_len_per_req,
        mask=call.mask,
    )


def context(call: ContextCall, workspace: torch.Tensor) -> torch.Tensor:
    import flashinfer

    cap = call.logits_soft_cap
    query = call.query
    if call.kv_cache.dtype == FP8_E4M3:
        query = quantize(query, 1.0, FP8_E4M3)
    return flashinfer.prefill.trtllm_fmha_v2_prefill(
        (query, call.kv_cache),
        "Q_PAGED_KV_HND",
        workspace,
        seq_lens=call.seq_lens,
        max_q_len=call.max_q_len,
        max_kv_len=call.max_kv_len,
        # The binding divides bmm1_scale by the cap itself: scores are cap * tanh(qk * scale / cap).
        bmm1_scale=call.bmm1_scale * call.k_scale,
        bmm2_scale=call.v_scale,
        batch_size=call.batch_size,
        cum_seq_lens_q=call.cum_seq_lens_q,
        cum_seq_lens_kv=call.cum_seq_lens_kv,
        block_tables=call.block_tables,
        out_dtype=call.query.dtype,
        sinks=call.sinks,
        logits_soft_cap_scale=cap,
        mask_mode="sliding_window" if call.window_left >= 0 else "causal",
        window_left=call.window_left,
    )
