"""Why a request ended with an error, as every layer reports it (no torch: the front doors map
these to status codes)."""

from __future__ import annotations

import enum


class ErrorCode(str, enum.Enum):
    """Why a request ended with an error; the front doors map these to status codes."""

    INVALID_ARGUMENT = "invalid_argument"  # its own content: never retried
    INTERNAL = "internal"  # its own processing raised: never retried, the loop goes on
    UNAVAILABLE = "unavailable"  # the loop (or a rank) broke: may be retried elsewhere
