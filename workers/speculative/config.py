"""Speculative decoding settings, checked before anything is built."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from workers.models.gemma4_assistant import is_assistant

MAX_NUM_STEPS = 16
# Other engines' names: `nextn` is eagle, except for a Gemma 4 assistant draft, which is frozen-KV
# MTP as in SGLang (`resolve_algorithm`); `mtp` is frozen-KV MTP.
ALGORITHM_ALIASES = {"nextn": "eagle", "mtp": "frozen_kv_mtp"}
# Draft pool kinds each algorithm supports; the first is the default.
#   swa: the draft's sliding-window layers in an SWA pool on the target's allocator
#   full: every draft layer in a full-only pool on the target's allocator
#   target: the draft owns no KV and reads the target's pool (frozen KV)
DRAFT_POOLS = {
    "standalone": ("swa", "full"),
    "eagle": ("full",),
    "frozen_kv_mtp": ("target",),
}


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    algorithm: str
    draft_model: str
    num_steps: int = 3
    draft_pool: str | None = None  # None: the algorithm's default (standalone: swa when possible)
    draft_load_format: str = "auto"
    # With tensor parallelism: "shard" the draft over the target's ranks, or "replicate" it on
    # every rank (drafts too small to shard: fewer heads than ranks).
    draft_tp: str = "shard"
    # A file of target token ids the draft proposes from (its LM head keeps their rows only):
    # `workers/speculative/token_map.py`.
    token_map: str | None = None
    # Choose each decode step's draft length in 0..num_steps from measured acceptance and cost
    # (`workers/speculative/controller.py`); False: num_steps every step.
    adaptive: bool = True

    @classmethod
    def from_dict(cls, options: Mapping[str, Any]) -> SpecConfig:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - fields)
        if unknown:
            raise ValueError(f"speculative: unknown option(s) {unknown}; known: {sorted(fields)}")
        for required in ("algorithm", "draft_model"):
            if required not in options:
                raise ValueError(f"speculative.{required}: required")
        algorithm = resolve_algorithm(options["algorithm"], options["draft_model"])
        cfg = cls(**{**options, "algorithm": algorithm})
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if not isinstance(self.algorithm, str) or self.algorithm not in DRAFT_POOLS:
            known = sorted([*DRAFT_POOLS, *ALGORITHM_ALIASES])
            raise ValueError(f"speculative.algorithm: unknown {self.algorithm!r}; known: {known}")
        if not isinstance(self.num_steps, int) or not 1 <= self.num_steps <= MAX_NUM_STEPS:
            raise ValueError(
                f"speculative.num_steps: must be an integer in [1, {MAX_NUM_STEPS}], got {self.num_steps!r}"
            )
        if self.draft_pool is not None and self.draft_pool not in DRAFT_POOLS[self.algorithm]:
            raise ValueError(
                f"speculative.draft_pool: {self.algorithm} supports {list(DRAFT_POOLS[self.algorithm])}, "
                f"got {self.draft_pool!r}"
            )
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative.adaptive: true or false, got {self.adaptive!r}")
        if self.draft_tp not in ("shard", "replicate"):
            raise ValueError(f"speculative.draft_tp: 'shard' or 'replicate', got {self.draft_tp!r}")
        if not os.path.isfile(os.path.join(str(self.draft_model), "config.json")):
            raise ValueError(
                f"speculative.draft_model: {self.draft_model!r} is not a model directory with a config.json"
            )


def resolve_algorithm(name: Any, draft_model: Any) -> Any:
    """The algorithm an alias names: `nextn` is frozen_kv_mtp for a Gemma 4 assistant
    checkpoint (`Gemma4AssistantForCausalLM`), eagle for any other draft (as before)."""
    if not isinstance(name, str):
        return name
    if name == "nextn" and isinstance(draft_model, str) and is_assistant(draft_model):
        return "frozen_kv_mtp"
    return ALGORITHM_ALIASES.get(name, name)
