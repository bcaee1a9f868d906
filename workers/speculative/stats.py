"""Accept-length bookkeeping per request and per engine step."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class SpecStats:
    """One request's speculative decoding record. Accept length of a verify step = accepted
    drafts + 1 (the target's own token), as verified (before stop or length truncation)."""

    num_steps: int
    verify_steps: int = 0
    accept_lengths: list[int] = dataclasses.field(default_factory=list)
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)  # [num_steps] counts

    def __post_init__(self) -> None:
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.num_steps

    def record(self, accepted: int) -> None:
        self.verify_steps += 1
        self.accept_lengths.append(accepted + 1)
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    @property
    def draft_tokens(self) -> int:
        return self.verify_steps * self.num_steps

    @property
    def mean_accept_length(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0

    def copy(self) -> SpecStats:
        return SpecStats(self.num_steps, self.verify_steps, list(self.accept_lengths), list(self.accepted_per_position))
