"""The engine's grammar masks: one table of token bitmasks that the processor stage fills for a
whole batch at once on the host and applies on the device (`workers/processors.py`,
`GrammarMask`; docs/design.md §12.1)."""

from __future__ import annotations

import collections
import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from attention.batch import upload
from workers.grammar import Matcher, xgrammar

FILL_THREADS = max(1, min(8, (os.cpu_count() or 2) // 2))  # threads filling a batch's masks
ROWS_PER_THREAD = 16


@dataclasses.dataclass(frozen=True)
class MaskRow:
    """A logits row's grammar: its request's matcher, the uncommitted tokens before the row and
    the request's row in the request table (where its masks are kept)."""

    matcher: Matcher
    drafts: tuple[int, ...]
    owner: int


class GrammarMasks:
    """An engine's grammar masks, kept in one table of a row per request row and number of
    drafts before the logits row (a speculative round's positions): filled on the host (pinned
    on a GPU) for all rows of a call at once, uploaded to the device copy in one copy per depth,
    gathered and applied there by one kernel. A slot remembers what it holds (the matcher, its
    committed tokens and the drafts), so that a verify finds the masks its draft steps filled
    (a draft step's mask is the verify's at the same depth) and fills only its last position.
    Masks are filled while the forward that made the logits still runs (its launch came first).
    The host table is as wide as the matchers' masks (the tokenizer's ids), the device table as
    the LM head; its columns past the tokenizer stay zero: padding ids are never allowed."""

    def __init__(self, vocab_size: int, requests: int, depths: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.requests = requests
        self.depths = depths
        self.device = device
        self.everything = requests * depths  # a slot of every token allowed: rows without a grammar
        self._held: list[tuple | None] = [None] * self.everything  # (matcher, committed, drafts) per slot
        self._needed = [False] * self.everything  # whether the slot masks anything out
        self._host: torch.Tensor | None = None  # [slots + 1, the matchers' words] int32, allocated on first use
        self._device_table: torch.Tensor | None = None  # [slots + 1, words]
        self._covered = 0  # the ids the matchers' masks cover, set with the tables
        self._uploaded: torch.cuda.Event | None = None  # the last upload out of the host table
        self._fillers: dict[int, Any] = {}  # xgrammar's batch matchers by thread count

    def apply(self, logits: torch.Tensor, rows: Sequence[MaskRow | None], partial: bool = False) -> None:
        """-inf in `logits` (float32 `[len(rows), V]`, in place) outside each row's mask; rows
        without one (None) are left alone, and nothing is uploaded or applied when no row masks
        anything. `partial`: rows may score only part of the vocabulary (a draft vocabulary, a
        hot-token map) and so hold no token the grammar allows: such a row becomes uniform over
        the allowed tokens, a proposal that rejection sampling takes as exactly as any other."""
        masks = self.on_device(rows)
        if masks is None:
            return
        vocab = logits.shape[-1]
        xgr = xgrammar()
        xgr.apply_token_bitmask_inplace(logits, masks, vocab_size=vocab)
        if partial:  # (a row of every token allowed is never dead)
            logits.masked_fill_(torch.isneginf(logits.amax(dim=-1, keepdim=True)), 0.0)
            xgr.apply_token_bitmask_inplace(logits, masks, vocab_size=vocab)

    def on_device(self, rows: Sequence[MaskRow | None]) -> torch.Tensor | None:
        """Each row's bitmask on the device (int32 `[len(rows), words]`, every bit set for a row
        without a grammar), filled where needed; None when no row masks anything."""
        slots = [s if s != self.everything and self._needed[s] else self.everything for s in self.fill(rows)]
        if all(s == self.everything for s in slots):
            return None
        return self._device_table.index_select(0, upload(np.asarray(slots, dtype=np.int64), self.device))

    def fill(self, rows: Sequence[MaskRow | None]) -> list[int]:
        """The slot of each row's mask (every token for None), filled on the host and uploaded
        where it does not hold the row's mask yet: depth by depth, each matcher advanced (or
        rolled back) to its row's drafts, then one batched fill for the depth's rows. A row whose
        drafts the grammar refuses, or that lies past its end, masks nothing (its slot is not
        needed): acceptance stops before it, so nothing reads it."""
        slots, todo = [], collections.defaultdict(dict)
        for row in rows:
            if row is None:
                slots.append(self.everything)
                continue
            depth = len(row.drafts)
            slot = depth * self.requests + row.owner
            held = (row.matcher, row.matcher.committed, row.drafts)
            slots.append(slot)
            if self._held[slot] != held:
                if todo[depth].setdefault(slot, held) != held:
                    raise RuntimeError(f"grammar masks: two rows of request row {row.owner} at depth {depth}")
        if todo:
            self._fill(todo)
        return slots

    def _fill(self, todo: dict[int, dict[int, tuple]]) -> None:
        if self._uploaded is not None:  # its rows may still be on their way to the device
            self._uploaded.synchronize()
        for depth in sorted(todo):
            live, live_slots = [], []
            for slot, (matcher, _, drafts) in todo[depth].items():
                if matcher.vocab_size != self._covered:
                    self._allocate(matcher.vocab_size)
                if matcher.seek(drafts):
                    live.append(matcher.native)
                    live_slots.append(slot)
            if live:
                self._filler(len(live)).batch_fill_next_token_bitmask(live, self._host, live_slots)
                if self._device_table is not self._host:
                    lo, hi = min(live_slots), max(live_slots) + 1
                    self._device_table[lo:hi, : self._host.shape[1]].copy_(self._host[lo:hi], non_blocking=True)
            filled = set(live_slots)
            for slot, held in todo[depth].items():  # only once filled: a fill that raised is not held
                self._held[slot], self._needed[slot] = held, slot in filled
        if self.device.type == "cuda":
            self._uploaded = torch.cuda.Event()
            self._uploaded.record()

    def _allocate(self, vocab_size: int) -> None:
        """The tables, for matchers whose masks cover `vocab_size` ids (every grammar of the engine)."""
        if self._host is not None:
            raise RuntimeError(f"grammar masks: a grammar compiled for {vocab_size} tokens, others for {self._covered}")
        words = (vocab_size + 31) // 32
        if vocab_size > self.vocab_size or (vocab_size % 32 and vocab_size < self.vocab_size):
            # (xgrammar allows the ids past its vocabulary in its last word)
            raise RuntimeError(
                f"grammar masks: a grammar compiled for {vocab_size} tokens on a model of {self.vocab_size}: "
                "compile for the model's vocabulary or whole mask words of it (`GrammarCompiler.of_tokenizer`)"
            )
        gpu = self.device.type == "cuda"
        self._covered = vocab_size
        self._host = torch.full((self.everything + 1, words), -1, dtype=torch.int32, pin_memory=gpu)
        if not gpu and words == self.words:
            self._device_table = self._host
            return
        self._device_table = torch.zeros((self.everything + 1, self.words), dtype=torch.int32, device=self.device)
        self._device_table[self.everything] = -1

    def _filler(self, rows: int) -> Any:
        """xgrammar's batch matcher for `rows` rows: a thread per ROWS_PER_THREAD rows, at most
        FILL_THREADS (its threads start on every call: a few rows fill faster on one)."""
        threads = max(1, min(FILL_THREADS, rows // ROWS_PER_THREAD))
        if threads not in self._fillers:
            self._fillers[threads] = xgrammar().BatchGrammarMatcher(threads)
        return self._fillers[threads]
