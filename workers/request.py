"""A request's state as it moves through the scheduler."""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import TYPE_CHECKING, Any

import torch

from workers.logprobs import Logprobs
from workers.sampling_params import SamplingParams

if TYPE_CHECKING:
    from workers.grammar import Matcher
    from workers.speculative.drafter import DraftState


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop token id
    LENGTH = "length"  # max_new_tokens or the context length
    ABORT = "abort"
    ERROR = "error"  # this request's own processing raised; `Request.error` says what


@dataclasses.dataclass(eq=False)
class Request:
    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    generator: torch.Generator
    max_len: int  # prompt + generated tokens may not exceed this
    output_ids: list[int] = dataclasses.field(default_factory=list)
    row: int | None = None  # row in the request->token table while running
    kv_len: int = 0  # tokens whose KV is written
    finish_reason: FinishReason | None = None
    logits: list[torch.Tensor] = dataclasses.field(default_factory=list)
    logprobs: Logprobs | None = None  # of each generated token, when the sampling asks
    prompt_logprobs: Logprobs | None = None  # of each prompt token after the first, when asked
    spec: DraftState | None = None  # speculative decoding state, when a draft model runs
    grammar: Matcher | None = None  # its structured outputs' matcher, over its committed tokens
    error: str | None = None  # why the request failed (finish reason ERROR)
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    cache_match: Any = None  # the prefix cache's match it holds locked while it runs
    # another choice of the same prompt: this one is admitted once that one has prefilled the
    # prompt, and starts on its cached pages (n choices, one prefill: docs/design.md §11)
    leader: Request | None = None
    # time.monotonic() when it reached the engine, was admitted (KV reserved), got its first token
    arrived: float = dataclasses.field(default_factory=time.monotonic)
    admitted: float | None = None
    first_token_at: float | None = None

    def phase_seconds(self) -> tuple[float | None, float | None]:
        """(waiting for admission, admission to the first token): None for a phase not reached."""
        queue = None if self.admitted is None else self.admitted - self.arrived
        prefill = None if self.admitted is None or self.first_token_at is None else self.first_token_at - self.admitted
        return queue, prefill

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prefilled(self) -> bool:
        return self.kv_len >= len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids of positions [start, end) of prompt + output."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[max(0, start - n) : end - n]
