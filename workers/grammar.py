"""Structured outputs: what a request's text must match, compiled for the model's tokenizer, the
per-request matcher (docs/design.md §12.1); the engine's table of token masks is
`workers/grammar_masks.py`. Nothing here needs torch: the front doors parse and check structured
outputs with it.

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
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

MAX_SPEC_CHARS = 64 * 1024  # a schema, regex, grammar or all choices together
MAX_CHOICES = 1024
COMPILE_TIMEOUT_S = 10.0
MAX_GRAMMAR_BYTES = 64 * 2**20  # one compiled grammar's token-mask tables
CACHE_BYTES = 1024 * 2**20
CACHE_ENTRIES = 1024
COMPILE_THREADS = 2  # worker threads; each compile may use xgrammar's own threads as well
XGRAMMAR_THREADS = 2
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
    def native(self) -> Any:
        """xgrammar's matcher, standing where `seek` left it (the batched mask fill reads it)."""
        return self._matcher

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
