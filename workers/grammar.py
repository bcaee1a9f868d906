"""Structured outputs: what a request's text must match, compiled for the model's tokenizer, the
per-request matcher, and the engine's table of token masks that the processor stage fills for a
whole batch at once and applies on the device (`workers/processors.py`, `GrammarMask`;
docs/design.md §12.1).

Grammars are xgrammar's: a JSON schema, any JSON object, a regular expression, a choice of
strings or an EBNF grammar, each compiled once per tokenizer into per-state token masks.
Compiling is the costly part and a client chooses its input, so it never runs on the engine
loop: `GrammarCompiler.start` hands it to a worker thread (xgrammar releases the interpreter
lock while it compiles, so the loop keeps stepping) and returns at once; the request joins the
engine only when its grammar is ready. Input size, compile time and the compiled grammar's size
are bounded, and a request past a bound is refused naming its field. A compile past its time
bound cannot be stopped: its thread finishes it and the result is cached like any other, so
sending the same input again costs nothing more. Compiled grammars are cached by content.

JSON comes out compact (xgrammar without free whitespace: `", "` and `": "` between items), as
`json.dumps` writes it: free whitespace lets a model pad its output with blanks until it runs
out of tokens.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import math
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from attention.batch import upload

MAX_SPEC_CHARS = 64 * 1024  # a schema, regex, grammar or all choices together
MAX_CHOICES = 1024
COMPILE_TIMEOUT_S = 10.0
MAX_GRAMMAR_BYTES = 64 * 2**20  # one compiled grammar's token-mask tables
CACHE_BYTES = 1024 * 2**20
CACHE_ENTRIES = 1024
COMPILE_THREADS = 2  # worker threads; each compile may use xgrammar's own threads as well
XGRAMMAR_THREADS = 2
FILL_THREADS = max(1, min(8, (os.cpu_count() or 2) // 2))  # threads filling a batch's masks
ROWS_PER_THREAD = 16
KINDS = ("json", "regex", "choice", "grammar", "json_object")
INSTALL = "pip install --no-deps xgrammar==0.2.8"


@dataclasses.dataclass(frozen=True)
class StructuredOutputs:
    """vLLM's `structured_outputs`: set exactly one. `json`: a JSON schema (its text; a mapping
    is taken too), `regex`: a regular expression the whole text matches, `choice`: one of these
    strings, `grammar`: an EBNF grammar (xgrammar's, as llama.cpp's GBNF) with a `root` rule,
    `json_object`: any JSON object."""

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.json, Mapping):  # a schema as a mapping: its text, property order kept
            object.__setattr__(self, "json", json.dumps(self.json))
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))

    @classmethod
    def of(cls, value: object) -> StructuredOutputs | None:
        """From a mapping of its fields (what crosses a process boundary), itself or None."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"structured_outputs: must be an object with one of {list(KINDS)}, got {_short(value)}")
        unknown = sorted(set(value) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"structured_outputs: unknown field {_short(unknown[0])}; allowed: {list(KINDS)}")
        return cls(**value)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def field(self) -> str:
        """The request field an error names."""
        return f"structured_outputs.{self.kind}"

    def validate(self) -> None:
        """Raise ValueError naming the field: exactly one kind, of its type, within the size bounds."""
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs: set exactly one of {list(KINDS)}, got {given or 'none'}")
        field, value = self.field, getattr(self, self.kind)
        if self.kind == "json_object":
            if value is not True:
                raise ValueError(f"{field}: must be true or false, got {_short(value)}")
            return
        if self.kind == "choice":
            if not value or len(value) > MAX_CHOICES or not all(isinstance(c, str) and c for c in value):
                raise ValueError(f"{field}: must be 1 to {MAX_CHOICES} non-empty strings, got {_short(value)}")
            size = sum(len(c) for c in value)
        else:
            if not isinstance(value, str) or not value:
                raise ValueError(f"{field}: must be a non-empty string, got {_short(value)}")
            size = len(value)
        if size > MAX_SPEC_CHARS:
            raise ValueError(f"{field}: {size} characters, over the limit of {MAX_SPEC_CHARS}")
        if self.kind == "json":
            try:
                schema = json.loads(value)
            except (ValueError, RecursionError) as exc:
                raise ValueError(f"{field}: not a JSON schema: {_short(str(exc))}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"{field}: a JSON schema is an object or a boolean, got {type(schema).__name__}")

    def ebnf(self) -> str:
        """A choice as an EBNF grammar: each string a literal (JSON's escapes are EBNF's)."""
        return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice)


class Compilation:
    """A grammar being compiled for a request: ready when compiled or past its deadline."""

    def __init__(self, spec: StructuredOutputs, future: concurrent.futures.Future, timeout_s: float | None) -> None:
        self.spec = spec
        self.future = future
        self.timeout_s = timeout_s
        self.deadline = math.inf if timeout_s is None else time.monotonic() + timeout_s

    @property
    def ready(self) -> bool:
        return self.future.done() or time.monotonic() >= self.deadline

    def result(self) -> Any:
        """The compiled grammar, waiting up to the deadline; ValueError naming the field when it
        failed, was too large or did not compile in time."""
        try:
            return self.future.result(timeout=max(0.0, self.deadline - time.monotonic()) if self.timeout_s else None)
        except concurrent.futures.TimeoutError:
            raise ValueError(
                f"{self.spec.field}: not compiled within {self.timeout_s:g} s (the limit); simplify it"
            ) from None


class GrammarCompiler:
    """Compiles structured outputs for one tokenizer, off the caller's thread, cached by content."""

    def __init__(self, info: Any, timeout_s: float = COMPILE_TIMEOUT_S, max_bytes: int = MAX_GRAMMAR_BYTES) -> None:
        """`info`: xgrammar's `TokenizerInfo` (the vocabulary, the mask width, the stop tokens)."""
        self._compiler = xgrammar().GrammarCompiler(info, max_threads=XGRAMMAR_THREADS, cache_enabled=False)
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self._pool = concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar-compile")
        self._cache: collections.OrderedDict[StructuredOutputs, concurrent.futures.Future] = collections.OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def of_tokenizer(cls, tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> GrammarCompiler:
        """For a Hugging Face tokenizer, ending at the model's own stop tokens. Masks cover the
        tokenizer's ids, rounded up to whole mask words (xgrammar allows the ids past its vocabulary
        in the last word) and at most `vocab_size`; `GrammarMasks` widens them to an LM head wider
        than that, its padding ids never allowed. (xgrammar counts padding ids as special tokens,
        and a matcher looks each accepted token up among those one by one: a 2K tokenizer padded
        to 128K made every accepted token cost 20 us.)"""
        ids = tokenizer.get_vocab().values()
        size = max(len(ids), max(ids, default=-1) + 1, max(stop_token_ids, default=-1) + 1)
        info = xgrammar().TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=min(-(-size // 32) * 32, vocab_size), stop_token_ids=list(stop_token_ids)
        )
        return cls(info)

    def start(self, spec: StructuredOutputs, bounded: bool = True) -> Compilation:
        """Compile `spec` on a worker thread (or find it cached); returns at once. `bounded`: with
        the time bound (a rank that only follows rank 0's decision waits as long as it takes)."""
        with self._lock:
            future = self._cache.get(spec)
            new = future is None
            if new:
                future = self._cache[spec] = self._pool.submit(self._compile, spec)
            self._cache.move_to_end(spec)
        if new:  # outside the lock: a compile already done runs the callback here, and it locks
            future.add_done_callback(lambda _: self._evict())
        return Compilation(spec, future, self.timeout_s if bounded else None)

    def compile(self, spec: StructuredOutputs, bounded: bool = True) -> Any:
        """The compiled grammar, waiting for it (ValueError naming the field)."""
        return self.start(spec, bounded).result()

    def _compile(self, spec: StructuredOutputs) -> Any:
        compile_by_kind = {
            "json": lambda: self._compiler.compile_json_schema(spec.json, any_whitespace=False),
            "json_object": lambda: self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False),
            "regex": lambda: self._compiler.compile_regex(spec.regex),
            "choice": lambda: self._compiler.compile_grammar(spec.ebnf()),
            "grammar": lambda: self._compiler.compile_grammar(spec.grammar),
        }
        try:
            compiled = compile_by_kind[spec.kind]()
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's refusals
            raise ValueError(f"{spec.field}: cannot be compiled: {_first_line(exc)}") from None
        if compiled.memory_size_bytes > self.max_bytes:
            raise ValueError(
                f"{spec.field}: compiles to {compiled.memory_size_bytes / 2**20:.0f} MiB of token masks, "
                f"over the limit of {self.max_bytes / 2**20:.0f} MiB; simplify it"
            )
        return compiled

    def _evict(self) -> None:
        """Drop the least recently used finished entries past the cache's bounds."""
        with self._lock:
            done = [(k, f) for k, f in self._cache.items() if f.done()]
            total = sum(_bytes(f) for _, f in done)
            for key, future in done:
                if total <= CACHE_BYTES and len(self._cache) <= CACHE_ENTRIES:
                    break
                total -= _bytes(future)
                del self._cache[key]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class Matcher:
    """One request's place in its grammar: over its committed tokens, and perhaps further over
    uncommitted (draft) tokens a mask was taken after. Those are rolled back lazily, only as far
    as the next mask or commit needs: a speculative round's draft steps and verify advance it a
    token at a time, and committing the accepted drafts keeps them."""

    def __init__(self, compiled: Any) -> None:
        self._matcher = xgrammar().GrammarMatcher(compiled)
        self.vocab_size = compiled.tokenizer_info.vocab_size  # the ids its masks cover
        self.committed = 0  # tokens committed: with the drafts, what a mask is taken after
        self._ahead: list[int] = []  # uncommitted tokens the matcher has advanced over

    def accept(self, token: int) -> bool:
        """Advance over a committed token; False (and no change) if the grammar refuses it."""
        if self._ahead and self._ahead[0] == token:  # advanced over it already
            del self._ahead[0]
        else:
            self._settle()
            if not self._matcher.accept_token(token):
                return False
        self.committed += 1
        return True

    @property
    def finished(self) -> bool:
        """The grammar has taken a stop token: the output is complete."""
        return not self._ahead and self._matcher.is_terminated()

    def seek(self, drafts: Sequence[int]) -> bool:
        """Stand after the committed tokens and then `drafts`: False where the grammar refuses a
        draft or has ended before the last (no mask there)."""
        same = 0
        for have, want in zip(self._ahead, drafts):
            if have != want:
                break
            same += 1
        if same < len(self._ahead):
            self._matcher.rollback(len(self._ahead) - same)
            del self._ahead[same:]
        for token in drafts[same:]:
            # (an id past the grammar's vocabulary, a draft's padding id, is refused here: xgrammar
            # would log a warning for each)
            if token >= self.vocab_size or self._matcher.is_terminated() or not self._matcher.accept_token(token):
                return False
            self._ahead.append(token)
        return not self._matcher.is_terminated()

    def _settle(self) -> None:
        """Back to the committed tokens."""
        if self._ahead:
            self._matcher.rollback(len(self._ahead))
            self._ahead.clear()


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
                    live.append(matcher._matcher)
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


def xgrammar():
    """The xgrammar module; ValueError naming the field when it is not installed."""
    try:
        import xgrammar as xgr
    except ImportError:
        raise ValueError(f"structured_outputs: this server lacks the xgrammar package ({INSTALL})") from None
    return xgr


def _bytes(future: concurrent.futures.Future) -> int:
    return future.result().memory_size_bytes if future.exception() is None else 0


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return _short(text[0] if text else type(exc).__name__, 200)


def _short(value: object, limit: int = 64) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
