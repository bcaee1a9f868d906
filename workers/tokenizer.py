"""Tokenizer loading and incremental detokenization of streamed token ids."""

from __future__ import annotations

import os

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(model_dir: str):
    """The model directory's Hugging Face tokenizer, or None when it has none."""
    if not any(os.path.isfile(os.path.join(model_dir, name)) for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


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
        delta, self.sent = text[self.sent:end], max(self.sent, end)
        return delta


class StopStrings:
    """Cuts streamed text before the first stop string. Text that could still turn into a stop
    string (a suffix that is a proper prefix of one) is held back until the next delta says."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.text = ""
        self.sent = 0
        self.stopped = False

    def add(self, delta: str, final: bool = False) -> str:
        """The text to send now; after it `stopped` tells whether a stop string ended the text."""
        self.text += delta
        longest = max((len(s) for s in self.stops), default=0)
        hits = [i for i in (self.text.find(s, max(0, self.sent - longest + 1)) for s in self.stops) if i != -1]
        if hits:
            self.stopped = True
            end = max(self.sent, min(hits))
        elif final:
            end = len(self.text)
        else:
            held = max((k for s in self.stops for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
            end = len(self.text) - held
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out
