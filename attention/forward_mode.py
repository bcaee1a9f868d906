"""What one forward pass does; backends route kernels on it."""

from __future__ import annotations

import enum


class ForwardMode(enum.Enum):
    """Forward modes of docs/design.md §5.

    EXTEND: prefill or a prefill chunk (ragged query lengths, may have a cached prefix).
    DECODE: one new token per request (also draft decode steps).
    IDLE: this rank has no requests this step but takes part in collectives.
    TARGET_VERIFY: the target scores `num_draft_tokens` per request (uniform query length).
    DRAFT_EXTEND_V2: the draft catches up over the verified window (k + 1 rows per request, padded).
    """

    EXTEND = "EXTEND"
    DECODE = "DECODE"
    IDLE = "IDLE"
    TARGET_VERIFY = "TARGET_VERIFY"
    DRAFT_EXTEND_V2 = "DRAFT_EXTEND_V2"

    @property
    def writes_kv(self) -> bool:
        return self is not ForwardMode.IDLE
