"""CPU reference kernels: the TensorRT-LLM kernels' contracts, float32 math.

They read KV only through `block_tables` (never through the request->token table) and apply
the window and the verify mask the way the GPU kernels do; an FP8 cache is dequantised with the
call's scales as it is read.
"""

from __future__ import annotations

import torch

from attention.dense import causal_window_mask, dense_attention
from attention.kernels.calls import ContextCall, DecodeCall, _Common, cdiv, unpack_mask
from attention.kv_pool import dequantize


def _gather(call: _Common, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Request b's K and V, `[seq_len, Hkv, D]`, read page by page from the block table (an FP8
    cache's dequantised)."""
    kv_len, p = int(call.seq_lens[b]), call.page_size
    pages = call.block_tables[b, : cdiv(kv_len, p)].long()
    kv = call.kv_cache[pages]  # [n_pages, 2, Hkv, P, D]
    kv = kv.permute(1, 0, 3, 2, 4).reshape(2, -1, kv.shape[2], kv.shape[4])[:, :kv_len]
    return dequantize(kv[0], call.k_scale), dequantize(kv[1], call.v_scale)


def _attend(
    call: _Common, b: int, q: torch.Tensor, softcap: float | None, draft_mask: torch.Tensor | None
) -> torch.Tensor:
    k, v = _gather(call, b)
    kv_len, q_len = k.shape[0], q.shape[0]
    device = q.device
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)
    window = call.window_left + 1 if call.window_left >= 0 else None
    mask = causal_window_mask(q_pos, torch.arange(kv_len, device=device), window)
    if draft_mask is not None:  # the draft block (last q_len keys) follows the packed mask
        mask[:, kv_len - q_len :] &= draft_mask
    return dense_attention(q, k, v, mask, call.bmm1_scale, softcap, call.sinks)


def decode(call: DecodeCall) -> torch.Tensor:
    call.check()
    q = call.q_len_per_req
    draft = unpack_mask(call.mask, q) if q > 1 else None
    out = torch.empty(call.query.shape, dtype=torch.float32, device=call.query.device)
    for b in range(call.batch_size):
        rows = slice(b * q, (b + 1) * q)
        out[rows] = _attend(call, b, call.query[rows], None, None if draft is None else draft[b])
    return out.to(call.query.dtype)


def context(call: ContextCall) -> torch.Tensor:
    call.check()
    cu = call.cum_seq_lens_q.tolist()
    out = torch.empty(call.query.shape, dtype=torch.float32, device=call.query.device)
    for b in range(call.batch_size):
        if cu[b + 1] > cu[b]:
            out[cu[b] : cu[b + 1]] = _attend(call, b, call.query[cu[b] : cu[b + 1]], call.logits_soft_cap, None)
    return out.to(call.query.dtype)
