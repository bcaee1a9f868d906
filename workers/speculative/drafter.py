"""Draft workers: a draft model, the pool it reads and writes, and how it follows the target.

Every draft shares the target's allocator and request->token table: a draft entry at position
q lives at the same full-pool slot as the target's token at q, in the draft's own pool (or, for
frozen-KV drafts, nowhere: they read the target's pool, handed to each forward).

A drafter keeps each request's draft KV valid over draft positions [0, draft_len). After a
prefill chunk it *catches up* (`catch_up`, ragged): it runs on the entries it has not seen, and
where that reaches the request's pending token its last row proposes the first draft token of the
next round. A round then takes num_steps - 1 more single-token draft steps (`step`). After a
verify it catches up over one fixed window of num_steps + 1 entries per request
(`catch_up_verified`, `DRAFT_EXTEND_V2`): uniform, so the same kernel and graphs as the verify
serve it. Rows past a request's accepted tokens read padding and write draft KV only at slots of
rejected positions, which the round gives back right after; their logits are not read.

- standalone: the entry at draft position q consumes token q; the window starts after the
  pending token's entry (drafting already wrote the accepted ones; they are recomputed).
- eagle: the entry at q consumes token q + 1 and the target's hidden state at q; the window
  starts at the pending token's position, with the verify's hidden states (drafting used the
  draft's own).
- frozen_kv_mtp: no KV; no catch-up: the first draft step reads the target's hidden state.
  Step j's query sits j positions past the target's KV, or, for a draft whose steps stay in
  place (`drafts_in_place`: the Gemma 4 assistant), every step at the pending token's position.

A draft's logits may cover a subset of the target's vocabulary: a fixed one (`token_map`: an
EAGLE-3 draft vocabulary or a hot-token list) or one per row (`ForwardOutput.ids`: a centroid
head). Greedy drafts map their argmax to target ids; sampling sees target-wide logits, -inf
off the subset.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import torch

from attention import ForwardMode, KVPool
from attention.batch import upload
from workers.cuda_graphs import PADDING_TOKEN
from workers.forward_batch import ForwardBatch
from workers.model_runner import ForwardOutput, ModelRunner
from workers.processors import RequestHistory, at_work
from workers.request import Request
from workers.sampler import draw_each
from workers.scheduler import Scheduler
from workers.speculative.stats import SpecStats

HiddenRows = dict[str, tuple[int, torch.Tensor]]  # request id -> (position of row 0, target hidden rows)
Tokens = list[int] | torch.Tensor  # one token per request: on the host, or still on the device


@dataclasses.dataclass
class Proposal:
    """A catch-up's rows that propose each request's next first draft, a row per request."""

    logits: torch.Tensor
    hidden: torch.Tensor
    ids: torch.Tensor | None  # their columns' target ids (a subset head's)


@dataclasses.dataclass
class DraftState:
    """A request's draft-side state between rounds."""

    stats: SpecStats
    draft_len: int = 0  # draft positions [0, draft_len) hold valid draft KV
    next_token: int | torch.Tensor | None = None  # first draft token of the next round (0-d on the device: greedy)
    next_probs: torch.Tensor | None = None  # the distribution it was drawn from (None: greedy)
    next_hidden: torch.Tensor | None = None  # the draft hidden state the next step reads
    # The worker's plain-step count when the draft last proposed (stale once it grew); None while
    # the request is not decoding (before its prefill ends, after it ended and was counted).
    synced: int | None = None


class Drafter:
    """Standalone and EAGLE drafts: draft models with KV of their own."""

    fixed_window = True  # the catch-up after a verify has the same shape whatever was accepted
    # The last plain decode steps whose target hidden states a catch-up after them reads (None:
    # every one since the draft last caught up).
    hidden_kept: int | None = 0
    shift = 0  # the entry consuming the token at position p sits at draft position p - shift
    reads_hidden = False  # entries read the target's hidden states

    def __init__(
        self, algorithm: str, pool_kind: str, runner: ModelRunner, target: ModelRunner, scheduler: Scheduler
    ) -> None:
        self.algorithm = algorithm
        self.pool_kind = pool_kind
        self.runner = runner
        self.target = target
        self.scheduler = scheduler
        # A draft vocabulary (EAGLE-3): draft logits cover it, this maps its ids to the target's.
        self.token_map: torch.Tensor | None = getattr(runner.model, "draft_to_target", None)
        self.vocab_size = target.model.cfg.vocab_size
        # its rows may hold no token a grammar allows: a draft vocabulary, or a subset of each row's
        self.partial_vocab = self.token_map is not None or getattr(runner.model, "scores_subset", False)
        # Greedy rounds under grammars: off, drafts are the draft's own argmax (graphs, no reads
        # between steps) and only the verify is masked, each position after the drafts before
        # it; on, every draft step is masked after the drafts before it (a read a step)
        self.masked_drafts = False

    def greedy(self, logits: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Each row's most likely draft token, as a target id (on the device); `ids`: the target
        id of each row's logits columns (a subset head's `ForwardOutput.ids`)."""
        best = logits.argmax(dim=-1)
        if ids is not None:
            return ids.gather(1, best[:, None]).squeeze(1)
        return best if self.token_map is None else self.token_map[best]

    def greedy_masked(self, logits: torch.Tensor, ids: torch.Tensor | None, history: RequestHistory) -> torch.Tensor:
        """`greedy` under each row's grammar mask (`history`: the rows' requests and the drafts
        before them), all on the device. A draft vocabulary or subset is masked with the mask's
        bits at its columns' target ids (no target-wide row); a row left with no allowed token
        takes the first token the grammar allows, as the host path's uniform row would."""
        rows = [history.grammar(i) for i in range(logits.shape[0])]
        if self.token_map is None and ids is None:
            scores = logits.float()
            history.grammar_masks.apply(scores, rows)
            return scores.argmax(dim=-1)
        masks = history.grammar_masks.on_device(rows)
        if masks is None:
            return self.greedy(logits, ids)
        cols = ids if ids is not None else self.token_map.expand(logits.shape[0], -1)
        allowed = (masks.gather(1, cols >> 5) >> (cols & 31)) & 1 == 1
        scores = logits.float().masked_fill(~allowed, float("-inf"))
        best = cols.gather(1, scores.argmax(dim=-1, keepdim=True)).squeeze(1)
        return torch.where(torch.isneginf(scores.amax(dim=-1)), self._lowest_allowed(masks), best)

    def _lowest_allowed(self, masks: torch.Tensor) -> torch.Tensor:
        """Each row's lowest target id its bitmask allows (0 if none below the vocabulary size):
        its first nonzero word's lowest set bit, without expanding the mask to a bit a token."""
        word = (masks != 0).to(torch.int32).argmax(dim=1)  # (the first maximum)
        bits = masks.gather(1, word[:, None]).to(torch.int64) & 0xFFFFFFFF
        lowest = bits & -bits  # the lowest set bit alone
        bit = (lowest >> torch.arange(32, device=masks.device)).eq(1).to(torch.int32).argmax(dim=1)
        first = word.to(torch.int64) * 32 + bit
        return torch.where(first < self.vocab_size, first, 0)

    def target_logits(self, logits: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Draft logits over the target's vocabulary, -inf outside a draft vocabulary or a row's
        subset (`ids`): what sampling and rejection sampling read."""
        if ids is None and self.token_map is None:
            return logits
        full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        if ids is not None:
            return full.scatter_(1, ids, logits)
        full[:, self.token_map] = logits
        return full

    def goal(self, req: Request) -> int:
        """Draft positions that should hold entries once the target has run: the entries of
        the tokens the target has KV for and of the token after them (the pending token)."""
        return req.kv_len + 1 - self.shift

    def hidden_from(self, req: Request) -> int:
        """The first position whose target hidden state the next catch-up reads (an EAGLE
        entry at q reads the state at q)."""
        return req.spec.draft_len

    def catch_up(self, mode: ForwardMode, reqs: list[Request], hidden: HiddenRows, most: int | None = None) -> None:
        """Run the draft over each request's entries [draft_len, goal); with `most`, over at
        most that many entries in all (each request's next ones, in request order): a request
        that does not reach its goal proposes nothing yet."""
        todo = [(r, r.spec.draft_len, self.goal(r)) for r in reqs]
        todo = [(r, a, b) for r, a, b in todo if b > a]
        if most is not None:
            ends = itertools.accumulate(b - a for _, a, b in todo)
            todo = [(r, a, min(b, b - max(0, end - most))) for (r, a, b), end in zip(todo, ends)]
            todo = [(r, a, b) for r, a, b in todo if b > a]
        if not todo:
            return
        proposes = [b + self.shift == r.num_tokens for r, _, b in todo]
        ends = [end - 1 for end in itertools.accumulate(b - a for _, a, b in todo)]
        spec_hidden = None
        if self.reads_hidden:
            spec_hidden = torch.cat([_rows(hidden[r.rid], a, b) for r, a, b in todo])
        batch = ForwardBatch.build(
            mode,
            rows=[r.row for r, _, _ in todo],
            prefix_lens=[a for _, a, _ in todo],
            input_ids=[r.tokens(a + self.shift, b + self.shift) for r, a, b in todo],
            out_cache_loc=self.scheduler.slots(*map(list, zip(*todo))),
            req_to_token=self.scheduler.req_to_token,
            logits_rows=[e for e, p in zip(ends, proposes) if p],
            spec_hidden=spec_hidden,
        )
        proposing = [r for (r, _, _), p in zip(todo, proposes) if p]
        # only the proposing rows' outputs are read: the last layer's feed-forward runs on them alone
        batch.prune_to_logits = bool(proposing)
        out = self.runner.forward(batch)
        for r, _, b in todo:
            r.spec.draft_len = b
        self._propose(proposing, out.logits, out.hidden, range(len(proposing)), out.ids)

    def catch_up_verified(
        self,
        reqs: list[Request],
        starts: list[int],
        accepted: list[int] | torch.Tensor,
        width: int,
        hidden: torch.Tensor,
        tokens: torch.Tensor | None = None,
        propose: bool = True,
    ) -> Proposal | None:
        """After a verify of `width` = num_steps + 1 positions from each request's `starts`
        (the pending token's position), `accepted[i]` drafts of which were kept: one window of
        `width` entries per request; row accepted[i] proposes. `hidden`: the verify's hidden
        states, `width` rows per request.

        Launched before the host has read the verify (greedy rounds): `accepted` is on the
        device and `tokens` are the target's choices `[B * width]`, which equal the committed
        tokens up to each request's bonus (rows past it are padding whatever they hold);
        `settle_verified` records the outcome once the host knows it. Without `propose`, the
        proposing rows are returned, to `propose` from once the round is committed (a grammar's
        masks follow the committed tokens)."""
        firsts = [s + 1 - self.shift for s in starts]
        if tokens is None:
            ids = [r.tokens(a + self.shift, a + self.shift + width) for r, a in zip(reqs, firsts)]
            input_ids = [t + [PADDING_TOKEN] * (width - len(t)) for t in ids]
        else:  # placeholders: the ids come from the device
            input_ids = [[PADDING_TOKEN] * width for _ in reqs]
        batch = ForwardBatch.build(
            ForwardMode.DRAFT_EXTEND_V2,
            rows=[r.row for r in reqs],
            prefix_lens=firsts,
            input_ids=input_ids,
            out_cache_loc=self.scheduler.slots(reqs, firsts, [a + width for a in firsts]),
            req_to_token=self.scheduler.req_to_token,
            logits_rows=range(len(reqs) * width),
            spec_hidden=hidden if self.reads_hidden else None,
        )
        if tokens is not None:
            batch.use_device_ids(tokens)
        out = self.runner.forward(batch)
        if isinstance(accepted, torch.Tensor):
            rows = torch.arange(len(reqs), device=accepted.device) * width + accepted
            logits, ids = _logit_rows(out, rows)
            proposal = Proposal(logits, out.hidden.index_select(0, rows), ids)
            if not propose:
                return proposal
            self.propose(reqs, proposal)
            return None
        self.settle_verified(reqs, starts, accepted)
        rows = [i * width + n for i, n in enumerate(accepted)]
        logits, ids = _logit_rows(out, upload(np.asarray(rows, dtype=np.int64), out.logits.device))
        self._propose(reqs, logits, out.hidden, rows, ids)
        return None

    def propose(self, reqs: list[Request], proposal: Proposal) -> None:
        """Each request's next first draft from a catch-up's `proposal` (a row per request)."""
        self._propose(reqs, proposal.logits, proposal.hidden, range(len(reqs)), proposal.ids)

    def settle_verified(self, reqs: list[Request], starts: list[int], accepted: list[int]) -> None:
        """The catch-up after a verify left valid draft KV up to each request's pending token."""
        for r, s, n in zip(reqs, starts, accepted):
            r.spec.draft_len = s + 1 - self.shift + n + 1

    def step(self, reqs: list[Request], j: int, tokens: Tokens, hidden: torch.Tensor) -> ForwardOutput:
        """Draft step j (2..num_steps): each request's draft j-1 -> logits for draft j."""
        return self.runner.forward(self._step_batch(reqs, j, tokens, hidden), pool=self.step_pool)

    def chain(
        self,
        reqs: list[Request],
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        steps: int,
        first: int = 2,
        ahead: torch.Tensor | None = None,
        most: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Greedy draft steps first..first + steps - 1 in one graph replay: their tokens `[B,
        steps]` (target ids) and the first step's hidden states, or None when no chain graph
        covers this batch (the caller steps one by one).

        With `ahead` (device, `[B]`, at most `most`), the chain is the *next* round's, launched
        before the host has read this one: each request will have committed ahead[i] + 1
        tokens; slots are allocated for the furthest outcome."""
        batch = self._step_batch(reqs, first, tokens, hidden, reach=steps + most, next_round=ahead is not None)
        return self.runner.forward_chain(batch, steps, pool=self.step_pool, ahead=ahead, most=most)

    def draft_ahead(
        self, reqs: list[Request], accepted: torch.Tensor, best: torch.Tensor, hidden: torch.Tensor
    ) -> torch.Tensor | None:
        """The next round's drafts 2..k `[B, k - 1]`, launched before this round's read from the
        catch-up's proposals (already launched) and the accepted counts on the device; None
        (the next round drafts them) unless every request has room for the furthest outcome
        within its KV reservation and the pools have the pages free now (the round's trim
        gives them back)."""
        k = best.shape[1] - 1  # the target's choices: k + 1 a request
        if not self.scheduler.has_room_ahead(reqs, [r.num_tokens + 2 * k - self.shift for r in reqs]):
            return None
        tokens = torch.stack([r.spec.next_token for r in reqs])
        hidden = torch.stack([r.spec.next_hidden for r in reqs])
        out = self.chain(reqs, tokens, hidden, k - 1, ahead=accepted, most=k)
        return None if out is None else out[0]

    @property
    def step_pool(self) -> KVPool:
        """The pool draft steps read and write: the draft's own."""
        return self.runner.pool

    def _step_batch(
        self,
        reqs: list[Request],
        j: int,
        tokens: Tokens,
        hidden: torch.Tensor,
        reach: int = 1,
        next_round: bool = False,
    ) -> ForwardBatch:
        """Draft step j's batch (of the next round: each request one token longer, the round's
        bonus); slots are allocated for `reach` positions from its own, for the steps a chain
        runs after it."""
        prefix_lens, offset, locs = self._step_where(reqs, j, reach, next_round)
        batch = ForwardBatch.build(
            ForwardMode.DECODE,
            rows=[r.row for r in reqs],
            prefix_lens=prefix_lens,
            input_ids=_single_rows(tokens),
            out_cache_loc=locs,
            req_to_token=self.scheduler.req_to_token,
            logits_rows=range(len(reqs)),
            query_offset=offset,
            spec_hidden=hidden if self.reads_hidden else None,
        )
        return _with_device_ids(batch, tokens)

    def _step_where(
        self, reqs: list[Request], j: int, reach: int, next_round: bool
    ) -> tuple[list[int], int, torch.Tensor]:
        """Where draft step j's queries sit: positions, read-only offset, write slots."""
        positions = [r.num_tokens - 2 + j - self.shift + next_round for r in reqs]
        locs = self.scheduler.slots(reqs, positions, [q + 1 for q in positions], [q + reach for q in positions])
        return positions, 0, locs

    def _propose(
        self,
        reqs: list[Request],
        logits: torch.Tensor,
        hidden: torch.Tensor,
        rows: list[int],
        ids: torch.Tensor | None = None,
    ) -> None:
        """The first draft token of the next round for each request, from its row of `logits`
        (one per request; `ids`: their columns' target ids, for a subset head), and the draft
        hidden state of its row `rows[i]` of `hidden`."""
        if not reqs:
            return
        if all(r.sampling.greedy and not at_work(r, grammar=False) for r in reqs):  # argmax on the device: no sync
            if self.masked_drafts and any(r.grammar is not None for r in reqs):  # masked after the committed tokens
                best = self.greedy_masked(logits, ids, self.scheduler.history(reqs, partial_vocab=self.partial_vocab))
            else:
                best = self.greedy(logits, ids)
            picked = (
                hidden
                if rows == range(hidden.shape[0])
                else hidden.index_select(0, upload(np.asarray(rows, dtype=np.int64), hidden.device))
            )
            for r, token, state in zip(reqs, best.unbind(0), picked.unbind(0)):  # (views in one call)
                r.spec.next_token, r.spec.next_probs, r.spec.next_hidden = token, None, state
            return
        # through the processor stage, as the target will process the pending token's position
        drawn, errors = draw_each(
            self.target_logits(logits, ids),
            [r.sampling for r in reqs],
            [r.generator for r in reqs],
            self.scheduler.history(reqs, partial_vocab=self.partial_vocab),
        )
        for i, (r, t, p, row) in enumerate(zip(reqs, drawn.tokens, drawn.probs, rows)):
            if i in errors:
                self.scheduler.fail(r, errors[i])
            else:
                r.spec.next_token, r.spec.next_probs, r.spec.next_hidden = t, p, hidden[row]


class EagleDrafter(Drafter):
    shift = 1
    reads_hidden = True
    hidden_kept = None


class FrozenKVDrafter(Drafter):
    """Draft layers read the target's pool, swapped in for every forward; no KV of their own."""

    fixed_window = False  # step 1 of the next round sits at the new pending token's position
    reads_hidden = True
    hidden_kept = 1

    def __init__(
        self, algorithm: str, pool_kind: str, runner: ModelRunner, target: ModelRunner, scheduler: Scheduler
    ) -> None:
        super().__init__(algorithm, pool_kind, runner, target, scheduler)
        self.in_place = getattr(runner.model, "drafts_in_place", False)

    def query_offset(self, j: int) -> int:
        """How far past the target's KV end draft step j's query sits: j, or 1 (the pending
        token's position) for every step of a draft whose steps stay in place."""
        return 1 if self.in_place else j

    def goal(self, req: Request) -> int:
        return 0

    def hidden_from(self, req: Request) -> int:
        """Step 1 reads the target's state at the position before the pending token."""
        return req.kv_len - 1

    def catch_up(self, mode: ForwardMode, reqs: list[Request], hidden: HiddenRows, most: int | None = None) -> None:
        """Draft step 1 for requests whose pending token follows the target's KV: the pending
        token and the target's hidden state of the position before it (one entry a request:
        `most` bounds nothing)."""
        ready = [r for r in reqs if r.prefilled and r.kv_len == r.num_tokens - 1]
        if not ready:
            return
        rows = torch.cat([_rows(hidden[r.rid], r.kv_len - 1, r.kv_len) for r in ready])
        out = self.step(ready, 1, [r.output_ids[-1] for r in ready], rows)
        self._propose(ready, out.logits, out.hidden, range(len(ready)), out.ids)

    def catch_up_verified(
        self, reqs: list[Request], starts: list[int], accepted: list[int], width: int, hidden: torch.Tensor
    ) -> None:
        """Draft step 1 of the next round, from the verify's hidden state at the position before
        each new pending token; a frozen-KV head has no KV to catch up on."""
        rows = {r.rid: (s, hidden[i * width : (i + 1) * width]) for i, (r, s) in enumerate(zip(reqs, starts))}
        self.catch_up(ForwardMode.DRAFT_EXTEND_V2, reqs, rows)

    def settle_verified(self, reqs: list[Request], starts: list[int], accepted: list[int]) -> None:
        """No draft KV to account for."""

    def draft_ahead(
        self, reqs: list[Request], accepted: torch.Tensor, best: torch.Tensor, hidden: torch.Tensor
    ) -> torch.Tensor | None:
        """The next round's draft steps 1..k in one chain, launched before this round's read: step 1
        reads each request's bonus token (the target's choice after its accepted drafts) and
        the verify's hidden state at the position before it, both picked on the device. It also
        stands in for the catch-up: each request's next first draft and hidden state come from
        it. Returns drafts 2..k `[B, k - 1]`, or None when no chain graph covers the batch."""
        k, rows = best.shape[1] - 1, torch.arange(len(reqs), device=best.device)
        tokens = best[rows, accepted]
        hidden = hidden.view(len(reqs), k + 1, -1)[rows, accepted]
        out = self.chain(reqs, tokens, hidden, k, first=1, ahead=accepted, most=k)
        if out is None:
            return None
        drafts, first_hidden = out
        for r, token, state in zip(reqs, drafts[:, 0].unbind(0), first_hidden.unbind(0)):
            r.spec.next_token, r.spec.next_probs, r.spec.next_hidden = token, None, state
        return drafts[:, 1:]

    @property
    def step_pool(self) -> KVPool:
        """Frozen-KV draft steps read the target's pool."""
        return self.target.pool

    def _step_where(
        self, reqs: list[Request], j: int, reach: int, next_round: bool
    ) -> tuple[list[int], int, torch.Tensor]:
        """Read-only queries `query_offset(j)` positions past each request's target KV (of the
        next round: the KV one token longer); nothing written."""
        return [r.kv_len - 1 + next_round for r in reqs], self.query_offset(j), torch.zeros(0, dtype=torch.int64)


def _single_rows(tokens: Tokens) -> list[list[int]]:
    """One input token per request; placeholders when the tokens are still on the device."""
    if isinstance(tokens, torch.Tensor):
        return [[PADDING_TOKEN]] * tokens.shape[0]
    return [[t] for t in tokens]


def _with_device_ids(batch: ForwardBatch, tokens: Tokens) -> ForwardBatch:
    if isinstance(tokens, torch.Tensor):
        batch.use_device_ids(tokens)
    return batch


def _logit_rows(out: ForwardOutput, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows of a forward's logits and of their target ids (a subset head's)."""
    return out.logits.index_select(0, rows), None if out.ids is None else out.ids.index_select(0, rows)


def _rows(hidden: tuple[int, torch.Tensor], start: int, end: int) -> torch.Tensor:
    """Target hidden states of positions [start, end)."""
    first, rows = hidden
    if start < first or end - first > rows.shape[0]:
        raise RuntimeError(
            f"draft catch-up needs target hidden states of positions [{start}, {end}), "
            f"this forward has [{first}, {first + rows.shape[0]})"
        )
    return rows[start - first : end - first]


DRAFTERS = {"standalone": Drafter, "eagle": EagleDrafter, "frozen_kv_mtp": FrozenKVDrafter}
