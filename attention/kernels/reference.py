"""CPU reference kernels: the TensorRT-LLM kernels' contracts, float32 math.

They read KV only through `block_tables` (never through the request->token table) and apply
the window and the verify mask the way the GPU kernels do; an FP8 cache is dequantised with the
call's scales as it is read.
"""

from __future__ import annotations

import torch

from attention.dense import causal_window_mask, dense_attention, padded_groups
from attention.kernels.calls import ContextCall, DecodeCall, _Common, unpack_mask
from attention.kv_pool import dequantize


def _attend(
    call: _Common, starts: list[int], q_lens: list[int], softcap: float | None, draft: torch.Tensor | None
) -> torch.Tensor:
    """Each request's `q_lens[b]` query rows from `starts[b]` (the last positions of its KV)
    against its KV, read page by page from the block table (an FP8 cache's dequantised), float32
    `[T, H, D]`; requests attended together in padded groups. `draft` `[B, q, q]`: the draft
    block (each request's last q keys) follows the packed mask."""
    device = call.query.device
    out = torch.empty(call.query.shape, dtype=torch.float32, device=device)
    window = call.window_left + 1 if call.window_left >= 0 else None
    kv_lens_all = call.seq_lens.long()
    for members in padded_groups(q_lens, kv_lens_all.tolist()):
        idx = torch.tensor(members, device=device)
        kv_lens = kv_lens_all[idx]
        lens = torch.tensor([q_lens[b] for b in members], device=device)
        n, m = int(kv_lens.max()), int(lens.max())
        key_pos = torch.arange(n, device=device)
        row = torch.arange(m, device=device)
        in_kv = key_pos < kv_lens[:, None]  # [B, n]
        pages = torch.where(in_kv, call.block_tables[idx].long()[:, key_pos // call.page_size], 0)
        offsets = (key_pos % call.page_size).expand_as(pages)
        k = dequantize(call.kv_cache[pages, 0, :, offsets, :], call.k_scale)
        v = dequantize(call.kv_cache[pages, 1, :, offsets, :], call.v_scale)
        q_pos = kv_lens[:, None] - lens[:, None] + row  # [B, m]
        mask = causal_window_mask(q_pos, key_pos, window) & (row < lens[:, None])[:, :, None]
        if draft is not None:
            q = draft.shape[-1]
            rel = key_pos - (kv_lens[:, None] - q)  # [B, n]: the key's place in the draft block
            in_block = (rel >= 0) & (rel < q)
            follows = torch.gather(draft[idx], 2, rel.clamp(0, q - 1)[:, None, :].expand(-1, q, -1))
            mask &= ~in_block[:, None, :] | follows
        rows = torch.tensor([starts[b] for b in members], device=device)[:, None] + row
        queries = call.query[rows.clamp(max=call.query.shape[0] - 1)]  # (padding rows: any row)
        attended = dense_attention(queries, k, v, mask, call.bmm1_scale, softcap, call.sinks)
        real = row < lens[:, None]
        out[rows[real]] = attended[real]
    return out


def decode(call: DecodeCall) -> torch.Tensor:
    call.check()
    q = call.q_len_per_req
    draft = unpack_mask(call.mask, q) if q > 1 else None
    starts = [b * q for b in range(call.batch_size)]
    return _attend(call, starts, [q] * call.batch_size, None, draft).to(call.query.dtype)


def context(call: ContextCall) -> torch.Tensor:
    call.check()
    cu = call.cum_seq_lens_q.tolist()
    out = _attend(call, cu[:-1], [b - a for a, b in zip(cu, cu[1:])], call.logits_soft_cap, None)
    return out.to(call.query.dtype)
