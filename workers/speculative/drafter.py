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
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import torch

from attention import ForwardMode
from attention.batch import upload
from workers.cuda_graphs import PADDING_TOKEN
from workers.forward_batch import ForwardBatch
from workers.model_runner import ForwardOutput, ModelRunner
from workers.request import Request
from workers.sampler import draw_each
from workers.scheduler import Scheduler
from workers.speculative.stats import SpecStats

HiddenRows = dict[str, tuple[int, torch.Tensor]]  # request id -> (position of row 0, target hidden rows)
Tokens = list[int] | torch.Tensor  # one token per request: on the host, or still on the device


@dataclasses.dataclass
class DraftState:
    """A request's draft-side state between rounds."""

    stats: SpecStats
    draft_len: int = 0  # draft positions [0, draft_len) hold valid draft KV
    next_token: int | torch.Tensor | None = None  # first draft token of the next round (0-d on the device: greedy)
    next_probs: torch.Tensor | None = None  # the distribution it was drawn from (None: greedy)
    next_hidden: torch.Tensor | None = None  # the draft hidden state the next step reads


class Drafter:
    """Standalone and EAGLE drafts: draft models with KV of their own."""

    fixed_window = True  # the catch-up after a verify has the same shape whatever was accepted
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

    def goal(self, req: Request) -> int:
        """Draft positions that should hold entries once the target has run: the entries of
        the tokens the target has KV for and of the token after them (the pending token)."""
        return req.kv_len + 1 - self.shift

    def catch_up(self, mode: ForwardMode, reqs: list[Request], hidden: HiddenRows) -> None:
        """Run the draft over each request's entries [draft_len, goal)."""
        todo = [(r, r.spec.draft_len, self.goal(r)) for r in reqs]
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
            out_cache_loc=torch.cat([self.scheduler.slots(r, a, b) for r, a, b in todo]),
            req_to_token=self.scheduler.req_to_token,
            logits_rows=[e for e, p in zip(ends, proposes) if p],
            spec_hidden=spec_hidden,
        )
        out = self.runner.forward(batch)
        proposing = [r for (r, _, _), p in zip(todo, proposes) if p]
        for r, _, b in todo:
            r.spec.draft_len = b
        self._propose(proposing, out.logits, out.hidden, [e for e, p in zip(ends, proposes) if p])

    def catch_up_verified(
        self,
        reqs: list[Request],
        starts: list[int],
        accepted: list[int] | torch.Tensor,
        width: int,
        hidden: torch.Tensor,
        tokens: torch.Tensor | None = None,
    ) -> None:
        """After a verify of `width` = num_steps + 1 positions from each request's `starts`
        (the pending token's position), `accepted[i]` drafts of which were kept: one window of
        `width` entries per request; row accepted[i] proposes. `hidden`: the verify's hidden
        states, `width` rows per request.

        Launched before the host has read the verify (greedy rounds): `accepted` is on the
        device and `tokens` are the target's choices `[B * width]`, which equal the committed
        tokens up to each request's bonus (rows past it are padding whatever they hold);
        `settle_verified` records the outcome once the host knows it."""
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
            out_cache_loc=torch.cat([self.scheduler.slots(r, a, a + width) for r, a in zip(reqs, firsts)]),
            req_to_token=self.scheduler.req_to_token,
            logits_rows=range(len(reqs) * width),
            spec_hidden=hidden if self.reads_hidden else None,
        )
        if tokens is not None:
            batch.use_device_ids(tokens)
        out = self.runner.forward(batch)
        if isinstance(accepted, torch.Tensor):
            rows = torch.arange(len(reqs), device=accepted.device) * width + accepted
            self._propose(reqs, out.logits.index_select(0, rows), out.hidden.index_select(0, rows), range(len(reqs)))
            return
        self.settle_verified(reqs, starts, accepted)
        rows = [i * width + n for i, n in enumerate(accepted)]
        logits = out.logits.index_select(0, upload(np.asarray(rows, dtype=np.int64), out.logits.device))
        self._propose(reqs, logits, out.hidden, rows)

    def settle_verified(self, reqs: list[Request], starts: list[int], accepted: list[int]) -> None:
        """The catch-up after a verify left valid draft KV up to each request's pending token."""
        for r, s, n in zip(reqs, starts, accepted):
            r.spec.draft_len = s + 1 - self.shift + n + 1

    def step(self, reqs: list[Request], j: int, tokens: Tokens, hidden: torch.Tensor) -> ForwardOutput:
        """Draft step j (2..num_steps): each request's draft j-1 -> logits for draft j."""
        positions = [r.num_tokens - 2 + j - self.shift for r in reqs]
        batch = ForwardBatch.build(
            ForwardMode.DECODE,
            rows=[r.row for r in reqs],
            prefix_lens=positions,
            input_ids=_single_rows(tokens),
            out_cache_loc=torch.cat([self.scheduler.slots(r, q, q + 1) for r, q in zip(reqs, positions)]),
            req_to_token=self.scheduler.req_to_token,
            logits_rows=range(len(reqs)),
            spec_hidden=hidden if self.reads_hidden else None,
        )
        return self.runner.forward(_with_device_ids(batch, tokens))

    def _propose(self, reqs: list[Request], logits: torch.Tensor, hidden: torch.Tensor, rows: list[int]) -> None:
        """The first draft token of the next round for each request, from its row of `logits`
        (one per request), and the draft hidden state of its row `rows[i]` of `hidden`."""
        if not reqs:
            return
        if all(r.sampling.greedy for r in reqs):  # argmax stays on the device: no host sync
            best = logits.argmax(dim=-1)
            for i, (r, row) in enumerate(zip(reqs, rows)):
                r.spec.next_token, r.spec.next_probs, r.spec.next_hidden = best[i], None, hidden[row]
            return
        tokens, probs, errors = draw_each(logits, [r.sampling for r in reqs], [r.generator for r in reqs])
        for i, (r, t, p, row) in enumerate(zip(reqs, tokens, probs, rows)):
            if i in errors:
                self.scheduler.fail(r, errors[i])
            else:
                r.spec.next_token, r.spec.next_probs, r.spec.next_hidden = t, p, hidden[row]


class EagleDrafter(Drafter):
    shift = 1
    reads_hidden = True


class FrozenKVDrafter(Drafter):
    """Draft layers read the target's pool, swapped in for every forward; no KV of their own."""

    fixed_window = False  # step 1 of the next round sits at the new pending token's position
    reads_hidden = True

    def goal(self, req: Request) -> int:
        return 0

    def catch_up(self, mode: ForwardMode, reqs: list[Request], hidden: HiddenRows) -> None:
        """Draft step 1 for requests whose pending token follows the target's KV: the pending
        token and the target's hidden state of the position before it."""
        ready = [r for r in reqs if r.prefilled and r.kv_len == r.num_tokens - 1]
        if not ready:
            return
        rows = torch.cat([_rows(hidden[r.rid], r.kv_len - 1, r.kv_len) for r in ready])
        out = self._query(ready, [r.output_ids[-1] for r in ready], rows, offset=1)
        self._propose(ready, out.logits, out.hidden, list(range(len(ready))))

    def catch_up_verified(
        self, reqs: list[Request], starts: list[int], accepted: list[int], width: int, hidden: torch.Tensor
    ) -> None:
        """Draft step 1 of the next round, from the verify's hidden state at the position before
        each new pending token; a frozen-KV head has no KV to catch up on."""
        rows = {r.rid: (s, hidden[i * width : (i + 1) * width]) for i, (r, s) in enumerate(zip(reqs, starts))}
        self.catch_up(ForwardMode.DRAFT_EXTEND_V2, reqs, rows)

    def step(self, reqs: list[Request], j: int, tokens: Tokens, hidden: torch.Tensor) -> ForwardOutput:
        return self._query(reqs, tokens, hidden, offset=j)

    def _query(self, reqs: list[Request], tokens: Tokens, hidden: torch.Tensor, offset: int) -> ForwardOutput:
        """Read-only queries `offset` positions past each request's target KV."""
        batch = ForwardBatch.build(
            ForwardMode.DECODE,
            rows=[r.row for r in reqs],
            prefix_lens=[r.kv_len - 1 for r in reqs],
            input_ids=_single_rows(tokens),
            out_cache_loc=torch.zeros(0, dtype=torch.int64),
            req_to_token=self.scheduler.req_to_token,
            logits_rows=range(len(reqs)),
            query_offset=offset,
            spec_hidden=hidden,
        )
        return self.runner.forward(_with_device_ids(batch, tokens), pool=self.target.pool)


def _single_rows(tokens: Tokens) -> list[list[int]]:
    """One input token per request; placeholders when the tokens are still on the device."""
    if isinstance(tokens, torch.Tensor):
        return [[PADDING_TOKEN]] * tokens.shape[0]
    return [[t] for t in tokens]


def _with_device_ids(batch: ForwardBatch, tokens: Tokens) -> ForwardBatch:
    if isinstance(tokens, torch.Tensor):
        batch.use_device_ids(tokens)
    return batch


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
