"""Speculative decoding: draft workers, the verify/accept step loop and its statistics."""

from workers.spec.config import SpecConfig
from workers.spec.stats import SpecStats

__all__ = ["SpecConfig", "SpecStats"]
