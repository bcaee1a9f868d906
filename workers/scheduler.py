"""Continuous batching with chunked prefill and KV admission control.

Each step is either an EXTEND batch (prefill chunks of requests still reading their prompt,
at most `chunked_prefill_size` tokens in all) or a DECODE batch (every running request: one
token, or one speculative round). A request is admitted only when the worst case it can need —
full slots for its whole length plus the speculative lookahead, SWA slots for a window plus one
forward — fits beside the worst cases of the running ones, so a running request never meets a
full pool: requests wait instead.

SWA slots are given back (`release_windows`) only after the last forward of a step that may
read them: a draft model catching up after the target still reads the window behind its tokens.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from attention import ForwardMode
from workers.forward_batch import ForwardBatch
from workers.grammar_masks import GrammarMasks
from workers.memory import KVAllocator, ReqToTokenPool
from workers.memory.allocator import cdiv, expand_ranges
from workers.processors import RequestHistory, TokenCounts
from workers.radix_cache import RadixCache
from workers.request import FinishReason, Request

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ScheduledBatch:
    mode: ForwardMode
    reqs: list[Request]
    q_lens: list[int]  # new tokens per request (DECODE: 1; a speculative round takes more)
    samples: list[bool]  # whether request i gets a new token from this forward


@dataclasses.dataclass
class KVBudget:
    full_pages: int
    swa_pages: int


class Scheduler:
    def __init__(
        self,
        allocator: KVAllocator,
        req_to_token: ReqToTokenPool,
        chunked_prefill_size: int | None,
        max_running_requests: int,
        eos_token_ids: tuple[int, ...],
        lookahead: int = 0,
        cache: RadixCache | None = None,
        token_counts: TokenCounts | None = None,
        grammar_masks: GrammarMasks | None = None,
    ) -> None:
        """`lookahead`: positions a decode step may hold past the next token (a speculative
        round holds num_steps + 1 more); `token_counts`: the running requests' token counts the
        penalties read, by request row (`workers/processors.py`); `grammar_masks`: where their
        grammar masks are filled (`workers/grammar.py`)."""
        self.allocator = allocator
        self.lookahead = lookahead
        self.req_to_token = req_to_token
        self.chunk = chunked_prefill_size
        self.max_running = max_running_requests
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self._reserved = KVBudget(0, 0)
        self._needs: dict[str, KVBudget] = {}
        self.cache = cache
        self._shared: collections.Counter[int] = collections.Counter()  # cached pages running rows start on
        # Positions of a request whose draft KV is complete too (what may be cached); set by a drafter.
        self.cacheable_len: Callable[[Request], int] = lambda req: req.kv_len
        # The first position a later query of a request reads (its SWA window ends there), and
        # how far past it a request may run meanwhile: a draft catching up after plain decode
        # steps reads its SWA window from where it fell behind (set by the engine).
        self.window_from: Callable[[Request], int] = lambda req: req.kv_len
        # Whether the last step may have moved a window_from (windows that wait for a draft stay
        # put through most plain steps: `SpecWorker.windows_moved`)
        self.windows_moved: Callable[[], bool] = lambda: True
        self.finishes = 0  # requests ended so far
        self.draft_lag = 0
        self.token_counts = token_counts
        self.grammar_masks = grammar_masks

    # -- admission ---------------------------------------------------------------------
    def kv_need(self, prompt_len: int, max_len: int, shared_pages: int = 0) -> KVBudget:
        """Worst-case pages a request can hold at once, besides `shared_pages` cached pages it
        starts on."""
        p = self.allocator.page_size
        full = cdiv(max_len + self.lookahead, p) - shared_pages
        if not self.allocator.is_hybrid:
            return KVBudget(full, 0)
        window = self.allocator.sliding_window
        return KVBudget(full, min(full, cdiv(window - 1 + self._per_forward(prompt_len), p) + 1))

    def _per_forward(self, prompt_len: int) -> int:
        """Positions past its SWA window that a request's SWA pages are reserved for: its widest
        prefill chunk, or a decode step's lookahead and the plain steps its draft may fall behind
        (`draft_lag`), whichever is more."""
        chunk = max(1, min(self.chunk or prompt_len, prompt_len)) + (1 if self.lookahead else 0)
        return max(chunk, self.lookahead + 1 + self.draft_lag)

    def draft_lag_room(self) -> int | None:
        """Plain decode steps every running request's draft may fall behind within the SWA pages
        its admission reserved (`kv_need`): at least `draft_lag`, more for a request whose
        prefill chunk the reservation covers (the window then waits for the draft at no cost);
        no bound from a request whose SWA reservation holds every page it may ever hold (it
        ends within a window and a chunk of its prompt), None when no request sets one."""
        if not self.running:
            return self.draft_lag
        rooms = [
            self._per_forward(len(r.prompt_ids)) - self.lookahead - 1
            for r in self.running
            if self._needs[r.rid].swa_pages < self._needs[r.rid].full_pages
        ]
        return min(rooms) if rooms else None

    def check_fits(self, prompt_len: int, max_len: int) -> None:
        """Raise ValueError when a request could never be admitted, however long it waits."""
        need = self.kv_need(prompt_len, max_len)
        alloc = self.allocator
        swa_total = alloc.swa.num_pages if alloc.is_hybrid else 0
        if need.full_pages > alloc.full.num_pages or need.swa_pages > swa_total:
            raise ValueError(
                f"prompt_token_ids: a request of up to {max_len} tokens needs {need.full_pages} full and "
                f"{need.swa_pages} SWA KV pages; the pools have {alloc.full.num_pages} and {swa_total}"
            )

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def _admit(self) -> None:
        alloc = self.allocator
        swa_total = alloc.swa.num_pages if alloc.is_hybrid else 0
        while self.waiting and len(self.running) < self.max_running and self.req_to_token.num_free:
            req = self.waiting[0]
            if req.leader is not None and not (req.leader.prefilled or req.leader.finished):
                break  # its prompt's pages come from its leader's prefill, a step or a chunk away
            req.leader = None
            # A request asking for its prompt's logprobs computes its whole prompt: the simplest
            # exact choice (a hit's pages hold KV, not the logits of the positions they cover).
            # It still enters its pages in the cache (`cache_prompts`).
            matches = self.cache is not None and req.sampling.prompt_logprobs is None
            match = self.cache.match(req.prompt_ids) if matches else None
            shared = len(match.nodes) if match is not None else 0
            need = self.kv_need(len(req.prompt_ids), req.max_len, shared)
            pinned = len(self._shared.keys() | set(match.pages)) if match is not None else len(self._shared)
            if (
                self._reserved.full_pages + need.full_pages + pinned > alloc.full.num_pages
                or self._reserved.swa_pages + need.swa_pages > swa_total
            ):
                break
            self.waiting.popleft()
            req.row = self.req_to_token.alloc()
            if shared:
                self._start_on(req, match)
            self._needs[req.rid] = need
            self._reserved.full_pages += need.full_pages
            self._reserved.swa_pages += need.swa_pages
            req.admitted = time.monotonic()
            self.running.append(req)

    def _start_on(self, req: Request, match) -> None:
        """Point a new request's first pages at a cached prefix; it computes the rest."""
        if self.allocator.is_hybrid:
            self.allocator.share_prefix(req.row, match.pages, self.cache.swa_from(len(match.nodes)))
        else:
            self.allocator.share_prefix(req.row, match.pages)
        self.cache.lock(match)
        self._shared.update(match.pages)
        req.cache_match = match
        req.kv_len = req.cached_tokens = len(match.nodes) * self.allocator.page_size
        if req.spec is not None:
            req.spec.draft_len = req.kv_len  # the draft's KV of the prefix lies in the same pages

    def cache_prompts(self, reqs: list[Request]) -> None:
        """After a prefill step: the prompts' complete pages enter the prefix cache."""
        for req in reqs:
            if not req.finished:
                self._cache(req, min(len(req.prompt_ids), self.cacheable_len(req)))

    def _cache(self, req: Request, length: int) -> None:
        if self.cache is None or req.row is None:
            return
        pages = self.allocator.row_pages(req.row, length // self.allocator.page_size)
        tokens = req.tokens(0, min(length + 1, req.num_tokens))
        self.cache.insert(tokens, pages, self.allocator.swa_start(req.row))

    # -- one step ----------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        self._admit()
        prefilling = [r for r in self.running if not r.prefilled]
        if prefilling:
            return self._extend_batch(prefilling)
        if self.running:
            return self._decode_batch(self.running)
        return None

    def _extend_batch(self, reqs: list[Request]) -> ScheduledBatch:
        budget = self.chunk or sum(len(r.prompt_ids) for r in reqs)
        chosen, q_lens, samples = [], [], []
        for req in reqs:
            if budget <= 0:
                break
            n = min(len(req.prompt_ids) - req.kv_len, budget)
            budget -= n
            chosen.append(req)
            q_lens.append(n)
            samples.append(req.kv_len + n == len(req.prompt_ids))
        return ScheduledBatch(ForwardMode.EXTEND, chosen, q_lens, samples)

    def _decode_batch(self, reqs: list[Request]) -> ScheduledBatch:
        return ScheduledBatch(ForwardMode.DECODE, list(reqs), [1] * len(reqs), [True] * len(reqs))

    @staticmethod
    def logit_rows(sb: ScheduledBatch) -> list[range]:
        """Per request, the rows of the batch's tokens whose logits the forward computes: every
        row of a prefill chunk whose request asks for its prompt's logprobs, else the last row
        where the request samples. The forward's logits hold them in this order."""
        rows, start = [], 0
        for req, n, samples in zip(sb.reqs, sb.q_lens, sb.samples):
            if sb.mode is ForwardMode.EXTEND and req.sampling.prompt_logprobs is not None:
                rows.append(range(start, start + n))
            else:
                rows.append(range(start + n - 1, start + n) if samples else range(0))
            start += n
        return rows

    def history(
        self, reqs: list[Request], drafts: list[list[int]] | None = None, partial_vocab: bool = False
    ) -> RequestHistory:
        """What the processors of these rows read (one request per row; `drafts`: each row's
        uncommitted tokens before it; `partial_vocab`: rows a draft scored over part of the
        vocabulary)."""
        return RequestHistory(self.token_counts, reqs, self.eos_token_ids, drafts, self.grammar_masks, partial_vocab)

    def build(self, sb: ScheduledBatch) -> ForwardBatch:
        """Give the batch's new tokens KV slots and lay out its forward."""
        return ForwardBatch.build(
            sb.mode,
            rows=[r.row for r in sb.reqs],
            prefix_lens=[r.kv_len for r in sb.reqs],
            input_ids=[r.tokens(r.kv_len, r.kv_len + n) for r, n in zip(sb.reqs, sb.q_lens)],
            out_cache_loc=self.slots(
                sb.reqs, [r.kv_len for r in sb.reqs], [r.kv_len + n for r, n in zip(sb.reqs, sb.q_lens)]
            ),
            req_to_token=self.req_to_token,
            logits_rows=[row for rows in self.logit_rows(sb) for row in rows],
        )

    def slots(
        self, reqs: list[Request], starts: list[int], ends: list[int], allocate_to: list[int] | None = None
    ) -> torch.Tensor:
        """Full-pool slots of positions [starts[i], ends[i]) of each request, concatenated (int64,
        host); any not held yet up to `allocate_to` (default `ends`) are allocated first. One
        allocation and one table gather for the batch: no per-request tensor work."""
        rows = [r.row for r in reqs]
        self.allocator.extend_rows(rows, ends if allocate_to is None else allocate_to)
        of, pos = expand_ranges(starts, ends)
        return torch.from_numpy(self.req_to_token.host[np.asarray(rows, dtype=np.int64)[of], pos].astype(np.int64))

    def has_room_ahead(self, reqs: list[Request], ends: list[int]) -> bool:
        """Whether each request could hold slots up to `ends[i]` positions within its KV
        reservation, with the pages free now (work launched a round ahead borrows them for the
        furthest outcome; the round's trim gives back what it did not need)."""
        room = self.lookahead
        return all(e <= r.max_len + room for r, e in zip(reqs, ends)) and self.allocator.can_extend(
            {r.row: e for r, e in zip(reqs, ends)}
        )

    def trim(self, req: Request, keep: int = 0) -> None:
        """Give back slots held past the request's tokens (rejected drafts) and `keep` more
        positions (a verify in flight writes them); the pending token's slot stays."""
        if self.allocator.allocated_len(req.row) > req.num_tokens + keep:
            self.allocator.truncate(req.row, req.num_tokens + keep)

    def process(self, batch: ScheduledBatch, tokens: list[int]) -> list[tuple[Request, list[int]]]:
        """Commit a forward's KV and sampled tokens; returns (request, new tokens) pairs."""
        events = []
        sampled = iter(tokens)
        for req, n, samples in zip(batch.reqs, batch.q_lens, batch.samples):
            new = self.commit(req, [next(sampled)] if samples else [], req.kv_len + n)
            if new:
                events.append((req, new))
        return events

    def commit(self, req: Request, tokens: list[int], kv_len: int) -> list[int]:
        """Record that the target's KV covers `kv_len` positions and append `tokens` up to the
        first that finishes the request (which then gives back everything it holds)."""
        req.kv_len = kv_len
        if tokens and not req.output_ids:
            req.first_token_at = time.monotonic()
        emitted = []
        for token in tokens:
            if req.grammar is not None and not req.grammar.accept(token):  # masked out: never drawn
                self.fail(req, f"structured_outputs: the grammar refused token {token}")
                break
            req.output_ids.append(token)
            emitted.append(token)
            reason = self._finish_reason(req, token)
            if reason is not None:
                self.finish(req, reason)
                break
        return emitted

    def release_windows(self, reqs: list[Request]) -> None:
        """Give back the SWA slots that no later query of these requests can see."""
        if not self.allocator.is_hybrid or not self.windows_moved():
            return
        live = [req for req in reqs if not req.finished]
        self.allocator.release_windows([req.row for req in live], [self.window_from(req) for req in live])

    def _finish_reason(self, req: Request, token: int) -> FinishReason | None:
        sp = req.sampling
        if (token in self.eos_token_ids and not sp.ignore_eos) or token in sp.stop_token_ids:
            return FinishReason.STOP
        if req.grammar is not None and req.grammar.finished:  # its grammar took a stop token
            return FinishReason.STOP
        if len(req.output_ids) >= sp.max_new_tokens or req.num_tokens >= req.max_len:
            return FinishReason.LENGTH
        return None

    def fail(self, req: Request, error: BaseException | str) -> None:
        """End a request whose own processing raised; it gives back everything it holds."""
        if req.finished:
            return
        req.error = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        logger.warning("request %s failed: %s", req.rid, req.error)
        self.finish(req, FinishReason.ERROR)

    def finish(self, req: Request, reason: FinishReason) -> None:
        """End a request and give back everything it holds."""
        req.finish_reason = reason
        self.finishes += 1
        if req in self.waiting:
            self.waiting.remove(req)
            return
        self.running.remove(req)
        if reason is not FinishReason.ERROR:  # a failed request's KV is not trusted
            self._cache(req, min(req.num_tokens, self.cacheable_len(req)))
        if req.cache_match is not None:
            self.cache.unlock(req.cache_match)
            self._shared.subtract(req.cache_match.pages)
            self._shared += collections.Counter()  # drop pages no running row shares any more
            req.cache_match = None
        self.allocator.free(req.row)
        self.req_to_token.free(req.row)
        need = self._needs.pop(req.rid)
        self._reserved.full_pages -= need.full_pages
        self._reserved.swa_pages -= need.swa_pages
        req.row = None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
