"""Token sampling: greedy, temperature, top-k, top-p, per-request seeded generators.

`sampling_probs` is the one definition of the distribution a request samples from; the
speculative verifier's rejection sampling uses it too. `draw_each` keeps one request's bad
row from failing the others: when the batch raises, rows are drawn one by one and only the
rows that raise again are reported as failed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from attention.batch import upload
from workers.sampling_params import SamplingParams


def sampling_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Probabilities `[B, V]` after temperature, top-k and top-p (rows must not be greedy)."""
    device = logits.device
    vocab = logits.shape[-1]
    ks = np.array([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], dtype=np.int64)
    ps = np.array([p.top_p for p in params], dtype=np.float32)
    temps, top_ks, top_ps = (
        upload(a, device) for a in (np.array([p.temperature for p in params], dtype=np.float32), ks, ps)
    )
    logits = logits.float() / temps[:, None]
    if (ks < vocab).any() or (ps < 1.0).any():  # decided on the host: no device read
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=device)[None, :]
        drop = ranks >= top_ks[:, None]
        sorted_probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop |= mass_before >= top_ps[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.softmax(logits, dim=-1)


def draw(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
) -> tuple[list[int], list[torch.Tensor | None]]:
    """One token per row of `logits` `[B, V]`, and the distribution it was drawn from (None for
    greedy rows): speculative verification needs the draft's distributions."""
    tokens = logits.argmax(dim=-1)
    probs: list[torch.Tensor | None] = [None] * len(params)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        dists = sampling_probs(logits[random_rows], [params[i] for i in random_rows])
        for j, i in enumerate(random_rows):
            tokens[i] = torch.multinomial(dists[j], 1, generator=generators[i])[0]
            probs[i] = dists[j]
    return tokens.tolist(), probs


def draw_each(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
) -> tuple[list[int | None], list[torch.Tensor | None], dict[int, Exception]]:
    """`draw`, isolating failures: (tokens, distributions, {row: exception}); a failed row's
    token is None. A failure costs the other rows their reproducibility for this draw only
    (their generators were advanced by the failed batch attempt)."""
    try:
        tokens, probs = draw(logits, params, generators)
        return list(tokens), probs, {}
    except Exception:  # noqa: BLE001 - find the rows that raise on their own
        tokens, probs, errors = [None] * len(params), [None] * len(params), {}
        for i, (p, g) in enumerate(zip(params, generators)):
            try:
                (tokens[i],), (probs[i],) = draw(logits[i : i + 1], [p], [g])
            except Exception as exc:  # noqa: BLE001 - reported per row
                errors[i] = exc
        return tokens, probs, errors


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
) -> list[int]:
    """One token per row of `logits` `[B, V]`."""
    return draw(logits, params, generators)[0]
