"""Dense float32 attention: the math every reference path shares."""

from __future__ import annotations

import torch

# Padded query-key pairs (over the requests) one batched product may span: requests are grouped
# so that a long prefill does not pad a batch of short ones to its size (`padded_groups`).
GROUP_PAIRS = 1 << 22


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q `[..., m, H, D]`, k/v `[..., n, Hkv, D]`, mask `[..., m, n]` (True = attend) ->
    `[..., m, H, D]` float32; leading dimensions are requests (padded: their padding masked
    out; a query row that sees no key comes out NaN).

    GQA: query head h reads KV head h // (H / Hkv); a sink adds exp(sink) of its head to the
    softmax denominator.
    """
    kv_heads = k.shape[-2]
    group = q.shape[-2] // kv_heads
    q = q.float().unflatten(-2, (kv_heads, group))  # [..., m, Hkv, G, D]
    scores = torch.einsum("...mkgd,...nkd->...kgmn", q, k.float()) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask[..., None, None, :, :], float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(kv_heads, group, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.einsum("...kgmn,...nkd->...mkgd", probs, v.float()).flatten(-3, -2)


def causal_window_mask(q_pos: torch.Tensor, kv_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """`[..., m, n]` from q_pos `[..., m]` and kv_pos `[..., n]`: key at kv_pos visible to query
    at q_pos (causal, and within `window` keys counting the query itself when a window is given)."""
    kv_pos, q_pos = kv_pos.unsqueeze(-2), q_pos.unsqueeze(-1)
    mask = kv_pos <= q_pos
    if window is not None:
        mask &= kv_pos > q_pos - window
    return mask


def padded_groups(q_lens: list[int], kv_lens: list[int]) -> list[list[int]]:
    """The requests with queries (indices, in order) in runs whose padded product
    (requests x longest query run x longest key run) stays within GROUP_PAIRS."""
    groups: list[list[int]] = []
    m = n = 0
    for i, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        if not q_len:
            continue
        grown = (max(m, q_len), max(n, kv_len))
        if groups and (len(groups[-1]) + 1) * grown[0] * grown[1] <= GROUP_PAIRS:
            groups[-1].append(i)
            m, n = grown
        else:
            groups.append([i])
            m, n = q_len, kv_len
    return groups
