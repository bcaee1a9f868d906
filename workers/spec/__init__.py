"""Speculative decoding: draft workers, the verify/accept step loop and its statistics."""

from workers.spec.config import SpecConfig
from workers.spec.stats import ForwardRecord, SpecStats, StepRecord

__all__ = ["ForwardRecord", "SpecConfig", "SpecStats", "StepRecord"]
