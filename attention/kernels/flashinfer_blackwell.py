"""Blackwell (SM100/SM103) kernels through flashinfer's trtllm-gen backend.

trtllm-gen ships precompiled cubins that flashinfer downloads at first use; on a machine
without network access to its artifact store these calls fail at that download. This path
mirrors the Hopper one call for call but has not been run by this project's CI or benchmarks.
"""

from __future__ import annotations

import torch

from attention.kernels.calls import ContextCall, DecodeCall


def decode(call: DecodeCall, workspace: torch.Tensor) -> torch.Tensor:
    import flashinfer

    # trtllm-gen applies the causal mask inside the draft block itself: no packed mask.
    return flashinfer.decode.trtllm_batch_decode_with_kv_cache(
        query=call.query,
        kv_cache=call.kv_cache,
        workspace_buffer=workspace,
        block_tables=call.block_tables,
        seq_lens=call.seq_lens,
        max_seq_len=call.max_seq_len,
        bmm1_scale=call.bmm1_scale,
        bmm2_scale=1.0,
        window_left=call.window_left,
        sinks=call.sinks,
        kv_layout="HND",
        backend="trtllm-gen",
        q_len_per_req=call.q_len_per_req,
    )


def context(call: ContextCall, workspace: torch.Tensor) -> torch.Tensor:
    import flashinfer

    return flashinfer.prefill.trtllm_batch_context_with_kv_cache(
        query=call.query,
        kv_cache=call.kv_cache,
        workspace_buffer=workspace,
        block_tables=call.block_tables,
        seq_lens=call.seq_lens,
        max_q_len=call.max_q_len,
        max_kv_len=call.max_kv_len,
        bmm1_scale=call.bmm1_scale,
        bmm2_scale=1.0,
        batch_size=call.batch_size,
        cum_seq_lens_q=call.cum_seq_lens_q,
        cum_seq_lens_kv=call.cum_seq_lens_kv,
        window_left=call.window_left,
        sinks=call.sinks,
        kv_layout="HND",
    )
