"""Speculative decoding: draft workers, the verify/accept step loop and its statistics."""

from workers.speculative.config import SpecConfig
from workers.speculative.stats import SpecStats

__all__ = ["SpecConfig", "SpecStats"]
