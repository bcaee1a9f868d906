"""Tokenizer loading, the text it can take, and incremental detokenization of streamed token ids."""

from __future__ import annotations

import json
import os

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


# `tokenizer_class` values for which AutoTokenizer builds transformers' plain `tokenizer.json`
# tokenizer (`PreTrainedTokenizerFast` is that class's other name): built directly, the same
# tokenizer without AutoTokenizer's import of the model configs, which loads torch (seconds in
# every front-door process).
PLAIN_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(model_dir: str):
    """The model directory's Hugging Face tokenizer, or None when it has none."""
    if not any(os.path.isfile(os.path.join(model_dir, name)) for name in TOKENIZER_FILES):
        return None
    try:
        if _tokenizer_class(model_dir) in PLAIN_TOKENIZER_CLASSES:
            from transformers.tokenization_utils_tokenizers import TokenizersBackend as Tokenizer
        else:
            from transformers import AutoTokenizer as Tokenizer
        return Tokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception as exc:  # transformers' and tokenizers' own types (JSON, sentencepiece, ...)
        raise ValueError(f"model: the tokenizer files in {model_dir!r} cannot be loaded: {exc!r}") from exc


def _tokenizer_class(model_dir: str) -> str | None:
    """`tokenizer_class` of the directory's tokenizer_config.json, when it has a tokenizer.json
    for that class to read (None otherwise: AutoTokenizer decides)."""
    config = os.path.join(model_dir, "tokenizer_config.json")
    if not (os.path.isfile(config) and os.path.isfile(os.path.join(model_dir, "tokenizer.json"))):
        return None
    with open(config, encoding="utf-8") as f:
        return json.load(f).get("tokenizer_class")


def unicode_problem(text: str) -> str | None:
    """What keeps `text` from being UTF-8 (and so from the tokenizer), or None: JSON may escape
    a lone surrogate (`"\\ud800"`) that no UTF-8 text holds."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"not valid Unicode text (a lone surrogate at character {exc.start})"
    return None


class IncrementalDetokenizer:
    """Text deltas for a growing list of token ids. A byte-level token may end inside a UTF-8
    character; such a tail (decoded as U+FFFD) is held back until the next token completes it."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text already returned

    def add(self, token_ids: list[int], final: bool = False) -> str:
        """The new text; on the `final` call everything left, incomplete characters too."""
        self.ids.extend(token_ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        end = len(text)
        while not final and end > self.sent and text[end - 1] == "\ufffd":
            end -= 1
        delta, self.sent = text[self.sent : end], max(self.sent, end)
        return delta


class StopStrings:
    """Cuts streamed text before the first stop string to be completed. Text that could still
    turn into a stop string (a suffix that is a proper prefix of one) is held back until the
    next delta says. Each stop string runs a Knuth-Morris-Pratt matcher over the text as it
    streams, so the cost is linear in the text whatever the lengths of the stop strings."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self._failure = [_prefix_function(s) for s in stops]
        self._matched = [0] * len(stops)  # longest prefix of each stop that ends the text so far
        self.pending = ""  # text not sent yet
        self.stopped = False

    def add(self, delta: str, final: bool = False) -> str:
        """The text to send now; after it `stopped` tells whether a stop string ended the text."""
        if self.stopped:
            return ""
        base = len(self.pending)
        self.pending += delta
        for offset, char in enumerate(delta):
            for i, stop in enumerate(self.stops):
                if self._advance(i, stop, char) == len(stop):
                    self.stopped = True
                    out, self.pending = self.pending[: base + offset + 1 - len(stop)], ""
                    return out
        held = 0 if final else max(self._matched, default=0)
        out, self.pending = self.pending[: len(self.pending) - held], self.pending[len(self.pending) - held :]
        return out

    def _advance(self, i: int, stop: str, char: str) -> int:
        q, failure = self._matched[i], self._failure[i]
        while q and stop[q] != char:
            q = failure[q - 1]
        if stop[q] == char:
            q += 1
        self._matched[i] = q
        return q


def _prefix_function(s: str) -> list[int]:
    """pi[i]: length of the longest proper prefix of s[:i + 1] that is also its suffix."""
    pi = [0] * len(s)
    for i in range(1, len(s)):
        q = pi[i - 1]
        while q and s[i] != s[q]:
            q = pi[q - 1]
        pi[i] = q + (s[i] == s[q])
    return pi
