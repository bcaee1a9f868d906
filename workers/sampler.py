"""Token sampling: processors, greedy, temperature, min_p, top-k, top-p, per-request seeded
generators, and the logprobs of what was drawn.

The one definition of the distribution a request samples from is `process`
(`workers/processors.py`: min_tokens, logit_bias, penalties on the raw logits) followed by
`distribution_logits` (temperature, then min_p, top-k and top-p, vLLM's order); a greedy row
takes the argmax of the processed logits. `sampling_probs` and `draw` are the two together;
the speculative verifier's rejection sampling uses the same functions on the verify's rows.
`draw_each` keeps one request's bad row from failing the others: when the batch raises, rows are
drawn one by one and only the rows that raise again are reported as failed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from attention.batch import upload
from workers.grammar_masks import GrammarMasks
from workers.logprobs import Logprobs, of_rows
from workers.processors import History, process
from workers.sampling_params import SamplingParams


@dataclasses.dataclass
class Drawn:
    """One token per row, the distribution it was drawn from (None for greedy rows: speculative
    verification needs the draft's distributions) and, where asked, its logprobs."""

    tokens: list[int | None]
    probs: list[torch.Tensor | None]
    logprobs: list[Logprobs | None]


def distribution_logits(processed: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The logits of the distribution each row's token comes from, given its processed logits
    (`process`): temperature, min_p, top-k and top-p applied (-inf where a token is ruled out) on
    sampled rows; greedy rows as they are (their token is the argmax; their logprobs are the
    processed logits' log_softmax, as vLLM's processed logprobs)."""
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not random_rows:
        return processed
    if len(random_rows) == len(params):
        return _warp(processed, params)
    out = processed.float().clone()
    index = upload(np.array(random_rows, dtype=np.int64), processed.device)
    out.index_copy_(0, index, _warp(processed.index_select(0, index), [params[i] for i in random_rows]))
    return out


def _warp(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, min_p, top-k, top-p (rows must not be greedy); which steps run is decided on
    the host from the parameters: no device read."""
    device = logits.device
    vocab = logits.shape[-1]
    ks = np.array([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], dtype=np.int64)
    ps = np.array([p.top_p for p in params], dtype=np.float32)
    min_ps = np.array([p.min_p for p in params], dtype=np.float32)
    temps = np.array([p.temperature for p in params], dtype=np.float32)
    logits = logits.float() / upload(temps, device)[:, None]
    if (min_ps > 0).any():  # drop tokens less likely than min_p x the most likely one
        probs = torch.softmax(logits, dim=-1)
        floor = upload(min_ps, device)[:, None] * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < floor, float("-inf"))
    if (ks < vocab).any() or (ps < 1.0).any():
        top_ks, top_ps = upload(ks, device), upload(ps, device)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=device)[None, :]
        drop = ranks >= top_ks[:, None]
        sorted_probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop |= mass_before >= top_ps[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


def sampling_probs(
    logits: torch.Tensor, params: Sequence[SamplingParams], history: History | None = None
) -> torch.Tensor:
    """Probabilities `[B, V]` after the processors, temperature, min_p, top-k and top-p (rows must
    not be greedy); `history`: what the processors count (None: nothing before the rows)."""
    return torch.softmax(distribution_logits(process(logits, params, history), params), dim=-1)


def draw(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
    history: History | None = None,
    logprobs: bool = False,
) -> Drawn:
    """One token per row of `logits` `[B, V]`; with `logprobs`, the logprobs of rows whose
    request asks for them."""
    processed = process(logits, params, history)
    tokens = processed.argmax(dim=-1)
    probs: list[torch.Tensor | None] = [None] * len(params)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    chosen = processed
    if random_rows:
        chosen = distribution_logits(processed, params)
        index = upload(np.array(random_rows, dtype=np.int64), logits.device)
        dists = torch.softmax(chosen.index_select(0, index), dim=-1)
        for j, i in enumerate(random_rows):
            tokens[i] = torch.multinomial(dists[j], 1, generator=generators[i])[0]
            probs[i] = dists[j]
    out: list[Logprobs | None] = [None] * len(params)
    asking = [i for i, p in enumerate(params) if logprobs and p.logprobs is not None]
    if asking:
        index = upload(np.array(asking, dtype=np.int64), logits.device)
        ks = [params[i].logprobs for i in asking]
        got = of_rows(chosen.index_select(0, index), tokens.index_select(0, index), ks)
        for j, i in enumerate(asking):
            out[i] = got.part(j, j + 1)
    return Drawn(tokens.tolist(), probs, out)


def draw_each(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
    history: History | None = None,
    logprobs: bool = False,
) -> tuple[Drawn, dict[int, Exception]]:
    """`draw`, isolating failures: (what was drawn, {row: exception}); a failed row's token is
    None. A failure costs the other rows their reproducibility for this draw only (their
    generators were advanced by the failed batch attempt)."""
    try:
        return draw(logits, params, generators, history, logprobs), {}
    except Exception:  # noqa: BLE001 - find the rows that raise on their own
        drawn, errors = Drawn([None] * len(params), [None] * len(params), [None] * len(params)), {}
        for i, (p, g) in enumerate(zip(params, generators)):
            try:
                one = draw(logits[i : i + 1], [p], [g], _RowOf(history, i) if history is not None else None, logprobs)
            except Exception as exc:  # noqa: BLE001 - reported per row
                errors[i] = exc
                continue
            drawn.tokens[i], drawn.probs[i], drawn.logprobs[i] = one.tokens[0], one.probs[0], one.logprobs[0]
        return drawn, errors


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
    history: History | None = None,
) -> list[int]:
    """One token per row of `logits` `[B, V]`."""
    return draw(logits, params, generators, history).tokens


@dataclasses.dataclass
class _RowOf:
    """Row `row` of a history, as the one row of a batch."""

    history: History
    row: int

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.history.eos_token_ids

    @property
    def grammar_masks(self) -> GrammarMasks | None:
        return self.history.grammar_masks

    @property
    def partial_vocab(self) -> bool:
        return self.history.partial_vocab

    def generated(self, row: int) -> int:
        return self.history.generated(self.row + row)

    def counts(self, rows: list[int], vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return self.history.counts([self.row + r for r in rows], vocab, device)

    def grammar(self, row: int):
        return self.history.grammar(self.row + row)
