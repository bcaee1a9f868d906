"""The logits processor stage: a row's raw logits -> the logits its token is chosen from.

`process` is the first half of the one definition of a request's distribution
(`workers/sampler.py` applies temperature, min_p, top-k and top-p after it; greedy rows take its
argmax). Its processors run in vLLM's order on the raw float32 logits:

    GrammarMask structured outputs: -inf outside the tokens the request's grammar allows
    MinTokens   EOS (unless ignore_eos) and stop_token_ids at -inf while fewer than min_tokens
                tokens were generated before the row's token
    LogitBias   OpenAI's logit_bias added
    Penalties   the repetition penalty (HF's and vLLM's: tokens of the prompt or the output,
                positive logits divided by it, negative ones multiplied), then OpenAI's
                frequency and presence penalties (count x frequency + (count > 0) x presence
                subtracted, counting the output)

A row is one position of one request. Its `History` says what plain decoding would have had
before that position: the tokens generated, and the token counts (committed tokens are counted on
the device per request, `TokenCounts`; a speculative round's rows add the drafts before them,
the prefix of the draft chain that would have been accepted to reach them). So every position of
a verify, and every draft step, is processed as plain decoding would process it there
(docs/design.md §12).

Which rows need work is decided on the host from their parameters and histories; rows without
processors are not touched, and a batch without any comes back as it is (no copy, no kernel).

The grammar mask of structured outputs (`GrammarMask`, `workers/grammar.py`) runs first, as in
vLLM: -inf outside the tokens the request's grammar allows after the row's history (its matcher
holds the committed tokens and is advanced over `RequestHistory.drafts[row]`). The masks of all
rows are filled on the host in one batch and applied on the device in one kernel
(`GrammarMasks`); on a GPU the host fills them while the forward that made the logits still runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from attention.batch import upload
from workers.grammar_masks import GrammarMasks, MaskRow
from workers.request import Request
from workers.sampling_params import SamplingParams


class History(Protocol):
    """What processors read about the rows of a batch."""

    eos_token_ids: frozenset[int]
    grammar_masks: GrammarMasks | None  # where rows with a grammar have their masks filled
    partial_vocab: bool  # rows may score only part of the vocabulary (a draft's proposals)

    def generated(self, row: int) -> int:
        """Tokens the row's request had generated before the row's token."""
        ...

    def counts(self, rows: list[int], vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """For these rows: how often each token was generated before the row's token (int32
        `[n, vocab]`), and which tokens the prompt or those generated tokens hold (bool)."""
        ...

    def grammar(self, row: int) -> MaskRow | None:
        """The row's structured-output matcher and the uncommitted tokens before the row that it
        must be advanced over (None: no grammar)."""
        ...


@dataclasses.dataclass
class TokenHistory:
    """A history from token lists, one prompt and one output per row: for rows outside an
    engine (a reference, a test); counted afresh on every call."""

    prompts: Sequence[Sequence[int]]
    outputs: Sequence[Sequence[int]]
    eos_token_ids: frozenset[int] = frozenset()
    grammar_masks: GrammarMasks | None = None
    partial_vocab: bool = False

    @classmethod
    def empty(cls, rows: int) -> TokenHistory:
        return cls([[]] * rows, [[]] * rows)

    def generated(self, row: int) -> int:
        return len(self.outputs[row])

    def counts(self, rows: list[int], vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        counts = _bincounts([self.outputs[r] for r in rows], vocab, device)
        prompt = _bincounts([self.prompts[r] for r in rows], vocab, device)
        return counts, (counts > 0) | (prompt > 0)

    def grammar(self, row: int) -> MaskRow | None:
        return None


class TokenCounts:
    """Per-request token counts on the device, one row of a table per request row (the
    request->token table's): how often each token was generated (frequency and presence
    penalties) and which tokens its prompt holds (the repetition penalty). Allocated when a
    request first needs it. Rows are brought up to date lazily and in one batch just before
    they are read: a request's prompt when it first needs its row, then the tokens it
    committed since."""

    def __init__(self, vocab_size: int, num_rows: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._output: torch.Tensor | None = None  # [rows, vocab] int32
        self._prompt: torch.Tensor | None = None  # [rows, vocab] bool
        self._holder: list[tuple[Request | None, int]] = [(None, 0)] * num_rows  # (request, outputs counted)

    def rows(self, reqs: Sequence[Request]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of these requests' rows: output counts (int32) and prompt presence (bool)."""
        self._sync(reqs)
        index = upload(np.array([r.row for r in reqs], dtype=np.int64), self.device)
        return self._output.index_select(0, index), self._prompt.index_select(0, index)

    def _sync(self, reqs: Sequence[Request]) -> None:
        if self._output is None:
            rows = len(self._holder)
            self._output = torch.zeros(rows, self.vocab_size, dtype=torch.int32, device=self.device)
            self._prompt = torch.zeros(rows, self.vocab_size, dtype=torch.bool, device=self.device)
        fresh, prompt_rows, prompt_ids, out_rows, out_ids = [], [], [], [], []
        for req in dict.fromkeys(reqs):  # each request once, in order
            holder, counted = self._holder[req.row]
            if holder is not req:  # a request new to this row: its prompt, nothing generated yet
                fresh.append(req.row)
                prompt_rows += [req.row] * len(req.prompt_ids)
                prompt_ids += req.prompt_ids
                counted = 0
            new = req.output_ids[counted:]
            out_rows += [req.row] * len(new)
            out_ids += new
            self._holder[req.row] = (req, len(req.output_ids))
        if fresh:
            index = self._index(fresh)
            self._output.index_fill_(0, index, 0)
            self._prompt.index_fill_(0, index, False)
        if prompt_ids:
            self._prompt.index_put_((self._index(prompt_rows), self._index(prompt_ids)), _true(self.device))
        if out_ids:
            ones = torch.ones(len(out_ids), dtype=torch.int32, device=self.device)
            self._output.index_put_((self._index(out_rows), self._index(out_ids)), ones, accumulate=True)

    def _index(self, values: list[int]) -> torch.Tensor:
        return upload(np.array(values, dtype=np.int64), self.device)


@dataclasses.dataclass
class RequestHistory:
    """The history of an engine's rows: each row's request (committed tokens counted in
    `table`) and the tokens before the row that are not committed (a verify's or a draft
    step's draft chain prefix; none when `drafts` is None)."""

    table: TokenCounts
    reqs: Sequence[Request]
    eos_token_ids: frozenset[int]
    drafts: Sequence[Sequence[int]] | None = None
    grammar_masks: GrammarMasks | None = None
    partial_vocab: bool = False
    _grammars: dict[int, MaskRow | None] = dataclasses.field(default_factory=dict, repr=False)

    def generated(self, row: int) -> int:
        return len(self.reqs[row].output_ids) + (len(self.drafts[row]) if self.drafts is not None else 0)

    def counts(self, rows: list[int], vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        counts, prompt = self.table.rows([self.reqs[r] for r in rows])
        if self.drafts is not None and any(self.drafts[r] for r in rows):
            counts += _bincounts([self.drafts[r] for r in rows], vocab, device)
        return counts, prompt | (counts > 0)

    def grammar(self, row: int) -> MaskRow | None:
        if row not in self._grammars:  # (asked for twice: which rows have one, then their masks)
            req = self.reqs[row]
            drafts = tuple(self.drafts[row]) if self.drafts is not None else ()
            self._grammars[row] = None if req.grammar is None or req.finished else MaskRow(req.grammar, drafts, req.row)
        return self._grammars[row]


class Processor(Protocol):
    """One step of the stage: on the host, the rows it acts on; on the device, its change to
    them (in place, float32 logits)."""

    def rows(self, params: Sequence[SamplingParams], history: History) -> list[int]: ...

    def apply(
        self, logits: torch.Tensor, rows: list[int], params: Sequence[SamplingParams], history: History
    ) -> None: ...


class GrammarMask:
    def rows(self, params: Sequence[SamplingParams], history: History) -> list[int]:
        return [i for i in range(len(params)) if history.grammar(i) is not None]

    def apply(self, logits: torch.Tensor, rows: list[int], params: Sequence[SamplingParams], history: History) -> None:
        grammars: list[MaskRow | None] = [None] * len(params)
        for row in rows:
            grammars[row] = history.grammar(row)
        history.grammar_masks.apply(logits, grammars, history.partial_vocab)


class MinTokens:
    def rows(self, params: Sequence[SamplingParams], history: History) -> list[int]:
        return [
            i
            for i, p in enumerate(params)
            if p.min_tokens and history.generated(i) < p.min_tokens and _stops(p, history)
        ]

    def apply(self, logits: torch.Tensor, rows: list[int], params: Sequence[SamplingParams], history: History) -> None:
        vocab = logits.shape[-1]
        pairs = [(r, t) for r in rows for t in sorted(_stops(params[r], history)) if t < vocab]
        if pairs:
            index = upload(np.array(pairs, dtype=np.int64).T.copy(), logits.device)
            logits[index[0], index[1]] = float("-inf")


class LogitBias:
    def rows(self, params: Sequence[SamplingParams], history: History) -> list[int]:
        return [i for i, p in enumerate(params) if p.logit_bias]

    def apply(self, logits: torch.Tensor, rows: list[int], params: Sequence[SamplingParams], history: History) -> None:
        at = np.array([(r, t) for r in rows for t, _ in params[r].logit_bias], dtype=np.int64).T.copy()
        bias = np.array([b for r in rows for _, b in params[r].logit_bias], dtype=np.float32)
        index = upload(at, logits.device)
        logits.index_put_((index[0], index[1]), upload(bias, logits.device), accumulate=True)


class Penalties:
    def rows(self, params: Sequence[SamplingParams], history: History) -> list[int]:
        return [i for i, p in enumerate(params) if p.penalized]

    def apply(self, logits: torch.Tensor, rows: list[int], params: Sequence[SamplingParams], history: History) -> None:
        device, vocab = logits.device, logits.shape[-1]
        counts, seen = history.counts(rows, vocab, device)
        values = np.array(
            [[params[r].repetition_penalty, params[r].frequency_penalty, params[r].presence_penalty] for r in rows],
            dtype=np.float32,
        )
        repetition, frequency, presence = upload(values, device).unbind(dim=1)
        index = upload(np.array(rows, dtype=np.int64), device)
        x = logits.index_select(0, index)
        penalty = torch.where(seen, repetition[:, None], 1.0)
        x = torch.where(x > 0, x / penalty, x * penalty)
        x -= frequency[:, None] * counts + presence[:, None] * (counts > 0)
        logits.index_copy_(0, index, x)


STAGE: tuple[Processor, ...] = (GrammarMask(), MinTokens(), LogitBias(), Penalties())


def process(
    logits: torch.Tensor, params: Sequence[SamplingParams], history: History | None = None, in_place: bool = False
) -> torch.Tensor:
    """The processed logits `[B, V]` of `logits`' rows (float32): `logits` itself when no row has
    a processor at work, a processed copy otherwise (`in_place`: `logits` processed, float32 and
    read by nobody else). `history`: None reads as rows with nothing before them."""
    history = history if history is not None else TokenHistory.empty(len(params))
    work = [(p, rows) for p in STAGE if (rows := p.rows(params, history))]
    if not work:
        return logits
    out = logits if in_place and logits.dtype == torch.float32 else logits.float().clone()
    for processor, rows in work:
        processor.apply(out, rows, params, history)
    return out


def at_work(req: Request, grammar: bool = True) -> bool:
    """Whether a processor may still change this request's next tokens (a minimum length acts
    only until it is reached): decided on the host, for choosing a round's path. `grammar`:
    whether its grammar mask counts."""
    p = req.sampling
    return (
        p.penalized or bool(p.logit_bias) or p.min_tokens > len(req.output_ids) or (grammar and req.grammar is not None)
    )


def _stops(params: SamplingParams, history: History) -> set[int]:
    """The tokens a minimum length holds back: the stop ids, and EOS unless it is ignored."""
    return set(params.stop_token_ids) | (set() if params.ignore_eos else set(history.eos_token_ids))


def _bincounts(tokens: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """Each list's token counts, int32 `[len(tokens), vocab]`."""
    counts = torch.zeros(len(tokens), vocab, dtype=torch.int32, device=device)
    rows = [i for i, seq in enumerate(tokens) for _ in seq]
    if rows:
        at = upload(np.array([rows, [t for seq in tokens for t in seq]], dtype=np.int64), device)
        counts.index_put_((at[0], at[1]), torch.ones(len(rows), dtype=torch.int32, device=device), accumulate=True)
    return counts


def _true(device: torch.device) -> torch.Tensor:
    return torch.ones((), dtype=torch.bool, device=device)
