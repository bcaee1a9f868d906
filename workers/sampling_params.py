"""Per-request sampling parameters, validated up front so bad input never takes resources.

Validation rejects every value the sampler cannot use, not only the obviously wrong ones: a
NaN, infinite or subnormal temperature turns logits into NaN and the sampler into an exception,
and a seed outside 64 bits cannot seed a generator.
"""

from __future__ import annotations

import dataclasses
import math

MIN_TEMPERATURE = 1e-5  # below this (and above 0) logits / temperature overflows float32
MAX_TEMPERATURE = 1e4
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes an unsigned 64-bit seed
MAX_TOKEN_ID = 2**31 - 1
MAX_STOP_TOKEN_IDS = 1024


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 means greedy
    top_k: int = -1  # -1 or 0: off
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    return_logits: bool = False  # keep each sampled step's float32 logits on the output

    def __post_init__(self) -> None:
        ids = () if self.stop_token_ids is None else self.stop_token_ids  # None: none, as vLLM reads it
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise ValueError(f"stop_token_ids: must be a list of token ids, got {ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise ValueError naming the offending field."""
        if not _is_int(self.max_new_tokens) or self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens: must be a positive integer, got {self.max_new_tokens!r}")
        if not _is_real(self.temperature) or not (
            self.temperature == 0.0 or MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE
        ):
            raise ValueError(
                f"temperature: must be 0 (greedy) or a number in [{MIN_TEMPERATURE:g}, "
                f"{MAX_TEMPERATURE:g}], got {self.temperature!r}"
            )
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p: must be a number in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= MAX_TOKEN_ID:
            raise ValueError(f"top_k: must be -1 (off), 0 (off) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"seed: must be an integer in [0, 2**64 - 1], got {self.seed!r}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        bad = [t for t in self.stop_token_ids if not _is_int(t) or not 0 <= t <= MAX_TOKEN_ID]
        if bad:
            raise ValueError(f"stop_token_ids: must be token ids in [0, 2**31 - 1], got {bad[:5]}")
        for name in ("ignore_eos", "return_logits"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be true or false, got {getattr(self, name)!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
