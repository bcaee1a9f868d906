"""Verification of a chain of draft tokens against the target.

Greedy requests accept drafts while they equal the target's argmax; the token after the last
accepted one is the target's argmax there. Sampling requests use rejection sampling (Leviathan
et al., Chen et al.): draft d drawn from q is kept with probability min(1, p(d) / q(d)); at the
first rejection the next token is drawn from normalise(max(p - q, 0)); when every draft is kept
the bonus token is drawn from p. The emitted tokens are distributed exactly as sampling from p
one token at a time.
"""

from __future__ import annotations

import torch


def verify_greedy(target_best: list[int], drafts: list[int]) -> tuple[int, int]:
    """target_best: the target's argmax after the pending token and after each draft (k + 1
    values); returns (accepted drafts n, the token that follows them)."""
    n = 0
    while n < len(drafts) and drafts[n] == target_best[n]:
        n += 1
    return n, target_best[n]


def verify_sampling(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    drafts: list[int],
    generator: torch.Generator,
) -> tuple[int, int]:
    """target_probs `[k+1, V]`, draft_probs `[k, V]` (the distributions the drafts were drawn
    from); returns (accepted drafts n, the token that follows them)."""
    device = target_probs.device
    for i, d in enumerate(drafts):
        p, q = target_probs[i], draft_probs[i]
        u = torch.rand((), generator=generator, device=device)
        if u * q[d] <= p[d]:
            continue
        residual = (p - q).clamp(min=0)
        total = residual.sum()
        dist = residual / total if total > 0 else p
        return i, int(torch.multinomial(dist, 1, generator=generator)[0])
    last = target_probs[len(drafts)]
    return len(drafts), int(torch.multinomial(last, 1, generator=generator)[0])
