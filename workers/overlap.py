"""Overlapped decoding: the host prepares and launches decode step N+1 while the device runs N.

A decode step's host work (scheduling, slots, batch and attention metadata, the launch) would
otherwise run while the GPU waits, because every step ends by copying its sampled tokens to the
host. Here step N+1 is launched before step N's tokens are read: its inputs are step N's tokens
still on the device, at the next position of every request (SGLang's overlap scheduler is the
model). Then step N's tokens are read and committed. A request that step N finishes was launched
once more; that row's result is dropped and its KV was freed with the request (later forwards on
the same stream run after the stale write). A request that step N's length limit ends is left out
of step N+1, since that is known on the host.

Only greedy decode steps without drafts overlap (their next inputs are an argmax on the
device: plain decoding, or the plain steps an adaptive speculative engine runs between rounds,
whose hidden states the draft keeps to catch up), and only for requests no logits processor acts
on but a grammar; anything else, and any request waiting to be admitted, drains the pipeline
first. A step with grammars takes its argmax after step N's tokens are committed (`choose`, as
SGLang's overlap scheduler): the matchers advance over them and the step's masks are filled on
the host while its forward runs, then applied on the device before the argmax.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch

from attention import ForwardMode
from workers.forward_batch import ForwardBatch
from workers.model_runner import ForwardOutput
from workers.processors import at_work
from workers.request import Request
from workers.scheduler import ScheduledBatch, Scheduler


@dataclasses.dataclass
class InFlight:
    """A launched forward's tokens, still on the device, with their copy to the host already
    queued behind it (and only it: reading them must not wait for work launched later on the
    same stream - the next decode step, or a speculative round's catch-up)."""

    reqs: list[Request]
    tokens: torch.Tensor | None  # [B] int64 on the device, one per request (a graph's: valid until its next replay)
    host_tokens: torch.Tensor | None  # [B] int64 on the host (pinned on a GPU), filled when `copied` is reached
    copied: torch.cuda.Event | None  # None on a CPU: the copy is done when queued
    hidden: torch.Tensor | None = None  # the step's hidden states, a row per request, where its forward kept them
    hidden_at: int | None = None  # the hidden ring row number its graph wrote them from (`ForwardBatch.hidden_at`)
    logits: torch.Tensor | None = None  # while its tokens wait for their grammar masks (`OverlapDecoder.choose`)

    @classmethod
    def of(cls, reqs: list[Request], tokens: torch.Tensor) -> InFlight:
        if tokens.device.type == "cpu":  # a copy: a graph's tokens are overwritten by its next replay
            return cls(reqs, tokens, tokens.clone(), None)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return cls(reqs, tokens, host, copied)

    def read(self) -> list[int]:
        """The step's tokens on the host: waits for this step only."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.host_tokens.tolist()


class OverlapDecoder:
    def __init__(self, scheduler: Scheduler, forward: Callable[[ForwardBatch], ForwardOutput]) -> None:
        """`forward(batch)` runs the target: its logits, and their argmax when a greedy decode
        graph took it."""
        self.scheduler = scheduler
        self.forward = forward

    @staticmethod
    def eligible(sb: ScheduledBatch) -> bool:
        """A decode step whose every request takes the argmax of its raw logits, or of its
        grammar-masked ones, and reads nothing else (no other processor at work, no logprobs or
        logits): the device's argmax serves it. Requests stay eligible: a processor that stops
        acting (min_tokens) never starts again."""
        return sb.mode is ForwardMode.DECODE and all(
            r.sampling.greedy and not r.sampling.reads_logits and not at_work(r, grammar=False) for r in sb.reqs
        )

    def can_continue(self, flight: InFlight) -> list[Request]:
        """The requests to launch next while `flight` is in the air: none when anything else
        waits to be scheduled."""
        if self.scheduler.waiting:
            return []
        launched = set(flight.reqs)  # (a list's `in` is a scan: a step at batch 64 took 4,096 comparisons)
        if any(r not in launched for r in self.scheduler.running if not r.finished):
            return []
        return [r for r in flight.reqs if not r.finished and not self._last_token_pending(r)]

    @staticmethod
    def _last_token_pending(req: Request) -> bool:
        """Whether the token in flight reaches the request's length limit."""
        return len(req.output_ids) + 1 >= req.sampling.max_new_tokens or req.num_tokens + 1 >= req.max_len

    def launch(self, reqs: list[Request], previous: InFlight | None, hidden_at: int | None = None) -> InFlight:
        """Launch a decode step: each request's last committed token (no step in flight) or the
        token `previous` sampled for it, at the position after it. A step with grammars has its
        tokens chosen by `choose`, once `previous` is committed. `hidden_at`: the hidden ring row
        number from which its graph keeps its hidden states (`ForwardBatch.hidden_at`)."""
        ahead = 1 if previous is not None else 0
        positions = [r.kv_len + ahead for r in reqs]
        ids = [[0] if previous is not None else r.tokens(r.kv_len, r.kv_len + 1) for r in reqs]
        batch = ForwardBatch.build(
            ForwardMode.DECODE,
            rows=[r.row for r in reqs],
            prefix_lens=positions,
            input_ids=ids,
            out_cache_loc=self.scheduler.slots(reqs, positions, [p + 1 for p in positions]),
            req_to_token=self.scheduler.req_to_token,
            logits_rows=range(len(reqs)),
        )
        batch.hidden_at = hidden_at
        if previous is not None:
            index = None if previous.reqs == reqs else np.array([previous.reqs.index(r) for r in reqs])
            batch.use_device_ids(previous.tokens, index)
        out = self.forward(batch)
        if any(r.grammar is not None for r in reqs):
            return InFlight(list(reqs), None, None, None, out.hidden, hidden_at, out.logits)
        flight = InFlight.of(list(reqs), out.tokens if out.tokens is not None else out.logits.argmax(dim=-1))
        flight.hidden, flight.hidden_at = out.hidden, hidden_at
        return flight

    def choose(self, flight: InFlight) -> None:
        """The tokens of a launched step whose requests have grammars: its logits masked where
        each request stands now (the step before committed; a request it finished is dropped),
        then their argmax, with its copy to the host queued. Nothing for a step chosen already."""
        if flight.tokens is not None:
            return
        history = self.scheduler.history(flight.reqs)
        history.grammar_masks.apply(flight.logits, [history.grammar(i) for i in range(len(flight.reqs))])
        chosen = InFlight.of(flight.reqs, flight.logits.argmax(dim=-1))
        flight.tokens, flight.host_tokens, flight.copied = chosen.tokens, chosen.host_tokens, chosen.copied
        flight.logits = None

    def collect(self, flight: InFlight) -> list[tuple[Request, list[int]]]:
        """Read a launched step's tokens (the step's one device-to-host copy, queued at launch) and
        commit them to the requests it still holds."""
        events = []
        for req, token in zip(flight.reqs, flight.read()):
            if req.finished:  # finished by the previous step, or aborted: this row is dropped
                continue
            new = self.scheduler.commit(req, [token], req.kv_len + 1)
            if new:
                events.append((req, new))
        return events
