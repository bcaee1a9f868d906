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
    draft_steps: list[int] = dataclasses.field(default_factory=list)  # drafts of each verify step (k <= num_steps)
    plain_steps: int = 0  # decode steps without drafts (the controller chose k = 0)

    def __post_init__(self) -> None:
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.num_steps

    def record(self, accepted: int, k: int) -> None:
        """A verify step of `k` drafts kept `accepted`."""
        self.verify_steps += 1
        self.accept_lengths.append(accepted + 1)
        self.draft_steps.append(k)
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    @property
    def draft_tokens(self) -> int:
        return sum(self.draft_steps)

    @property
    def mean_accept_length(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0

    def copy(self) -> SpecStats:
        return dataclasses.replace(
            self,
            accept_lengths=list(self.accept_lengths),
            accepted_per_position=list(self.accepted_per_position),
            draft_steps=list(self.draft_steps),
        )
