"""Log-probabilities in the shapes OpenAI's and vLLM's clients read, from the engine's
(`workers/logprobs.py`, on the wire as a dict of `token`, `top_ids`, `top`, `rank` lists).

- completions (`logprobs: k`): `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`,
  one entry per token; with `echo` the prompt's tokens come first, the first of them with
  `null` logprob and top logprobs (nothing predicts it). lm-evaluation-harness reads these.
- chat (`logprobs: true`, `top_logprobs: k`): `{"content": [{"token", "logprob", "bytes",
  "top_logprobs": [{"token", "logprob", "bytes"}]}]}`.
- vLLM's `prompt_logprobs`: a list, `null` for the first prompt token, then for each token a map
  from token id to `{"logprob", "rank", "decoded_token"}` holding the token and the k most likely.

JSON has no infinity: a logprob of a token the request's processors ruled out is -9999.0, as
vLLM sends it. Tokens are shown as their own decoded text (a byte-level token ending inside a
character shows U+FFFD; `bytes` are that text's UTF-8, as vLLM's).
"""

from __future__ import annotations

from typing import Any

FLOOR = -9999.0  # vLLM's stand-in for -inf
Wire = dict[str, list]  # `workers.logprobs.Logprobs` as a dict


def _finite(value: float) -> float:
    return max(value, FLOOR)


class TokenText:
    """Each token id's own text, decoded once."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self._text.get(token)
        if text is None:
            text = self._text[token] = (
                self.tokenizer.decode([token]) if self.tokenizer is not None else f"token_id:{token}"
            )
        return text

    def decode(self, ids: list[int]) -> str:
        """The text of a token sequence (a prompt shown by `echo`)."""
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""


def completion(
    logprobs: Wire | None, ids: list[int], text: TokenText, offset: int, first_unpredicted: bool = False
) -> dict[str, list]:
    """Completions' logprobs of `ids` (their text starting at character `offset`); with
    `first_unpredicted`, `ids[0]` has no logprob (the first prompt token) and `logprobs` covers
    the others."""
    tokens = [text(t) for t in ids]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    own: list[float | None] = [None] if first_unpredicted else []
    top: list[dict[str, float] | None] = [None] if first_unpredicted else []
    if logprobs is not None:  # as many entries as tokens it predicts (an echo-only answer shows none)
        count = len(ids) - len(own)
        own += [_finite(v) for v in logprobs["token"][:count]]
        top += [
            {text(t): _finite(v) for t, v in zip(top_ids, values)}
            for top_ids, values in zip(logprobs["top_ids"][:count], logprobs["top"][:count])
        ]
    return {"tokens": tokens, "token_logprobs": own, "top_logprobs": top, "text_offset": offsets}


def join_completion(earlier: dict[str, list] | None, later: dict[str, list]) -> dict[str, list]:
    if earlier is None:
        return later
    return {key: earlier[key] + later[key] for key in later}


def chat(logprobs: Wire | None, ids: list[int], text: TokenText) -> list[dict[str, Any]]:
    """Chat's `logprobs.content` entries of `ids`."""
    if logprobs is None:
        return []

    def entry(token: int, value: float) -> dict[str, Any]:
        shown = text(token)
        return {"token": shown, "logprob": _finite(value), "bytes": list(shown.encode("utf-8", "replace"))}

    return [
        {**entry(t, v), "top_logprobs": [entry(i, lp) for i, lp in zip(top_ids, values)]}
        for t, v, top_ids, values in zip(ids, logprobs["token"], logprobs["top_ids"], logprobs["top"])
    ]


def prompt(logprobs: Wire, ids: list[int], text: TokenText) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs` of the prompt `ids` (`logprobs` covers ids[1:])."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for token, value, rank, top_ids, values in zip(
        ids[1:], logprobs["token"], logprobs["rank"], logprobs["top_ids"], logprobs["top"]
    ):
        entries = {
            str(t): {"logprob": _finite(v), "rank": r, "decoded_token": text(t)}
            for r, (t, v) in enumerate(zip(top_ids, values), 1)
        }
        entries[str(token)] = {"logprob": _finite(value), "rank": rank, "decoded_token": text(token)}
        out.append(entries)
    return out
