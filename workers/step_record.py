"""What one engine step ran: its forwards in order, with timings, and its verify results.
Traces and metrics are built from these records (cluster.tracing)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ForwardRecord:
    """One forward pass of a step."""

    model: str  # "target" or "draft"
    mode: str  # ForwardMode name
    batch_size: int
    num_tokens: int
    kernel: str  # the attention kernel the backend runs for this mode
    start_ns: int  # wall clock (time.time_ns) around the forward, as seen by the host
    end_ns: int
    steps: int = 1  # forwards in one launch (a chain of draft steps in one CUDA graph)


@dataclasses.dataclass
class StepRecord:
    forwards: list[ForwardRecord] = dataclasses.field(default_factory=list)
    request_ids: list[str] = dataclasses.field(default_factory=list)  # requests this step served
    seq_lens: list[int] = dataclasses.field(default_factory=list)  # their lengths after the step
    cached_tokens: list[int] = dataclasses.field(default_factory=list)  # their prompt tokens the prefix cache held
    accept_lengths: dict[str, int] = dataclasses.field(default_factory=dict)  # request id -> accept length
    drafts: dict[str, list[int]] = dataclasses.field(default_factory=dict)  # request id -> verified drafts
    draft_steps: int | None = None  # a decode step's drafts per request (0: plain); None: no decode, or no draft model
    start_ns: int = 0
    end_ns: int = 0
