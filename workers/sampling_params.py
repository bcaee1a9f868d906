"""Per-request sampling parameters, validated up front so bad input never takes resources.

Validation rejects every value the sampler cannot use, not only the obviously wrong ones: a
NaN, infinite or subnormal temperature turns logits into NaN and the sampler into an exception,
and a seed outside 64 bits cannot seed a generator. Token ids are checked against the model's
vocabulary where the engine knows it (`Engine.check_request`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from workers.grammar import StructuredOutputs

MIN_TEMPERATURE = 1e-5  # below this (and above 0) logits / temperature overflows float32
MAX_TEMPERATURE = 1e4
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes an unsigned 64-bit seed
MAX_TOKEN_ID = 2**31 - 1
MAX_STOP_TOKEN_IDS = 1024
MAX_PENALTY = 2.0  # OpenAI's frequency and presence penalties lie in [-2, 2]
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = MIN_TEMPERATURE, MAX_TEMPERATURE  # divides logits, as temperature
MAX_LOGIT_BIAS = 100.0  # OpenAI's: a bias lies in [-100, 100]
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's limit on logit_bias entries
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 means greedy
    top_k: int = -1  # -1 or 0: off
    top_p: float = 1.0
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one (vLLM's); 0: off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS and stop_token_ids cannot be drawn before this many tokens
    frequency_penalty: float = 0.0  # OpenAI's: minus this x each token's count in the output
    presence_penalty: float = 0.0  # OpenAI's: minus this for each token present in the output
    repetition_penalty: float = 1.0  # HF's: tokens in prompt or output: positive logits / it, negative x it
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), by id; a mapping is taken too
    logprobs: int | None = None  # k: each generated token's logprob and the k most likely; None: none
    prompt_logprobs: int | None = None  # k: the same for every prompt token after the first; None: none
    return_logits: bool = False  # keep each sampled step's float32 logits on the output
    # the output matches this JSON schema, regex, choice or grammar (`workers/grammar.py`); a mapping is taken too
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        ids = () if self.stop_token_ids is None else self.stop_token_ids  # None: none, as vLLM reads it
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise ValueError(f"stop_token_ids: must be a list of token ids, got {ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        object.__setattr__(self, "structured_outputs", StructuredOutputs.of(self.structured_outputs))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether a penalty reads the request's token counts."""
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def processed(self) -> bool:
        """Whether a logits processor may change this request's argmax: a grammar, penalties, a
        logit bias or a minimum length (`workers/processors.py`); such rows never take a fused
        device argmax."""
        return self.structured_outputs is not None or self.penalized or bool(self.logit_bias) or self.min_tokens > 0

    @property
    def reads_logits(self) -> bool:
        """Whether the host reads this request's logits after each step (logprobs, kept logits)."""
        return self.return_logits or self.logprobs is not None

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
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p: must be a number in [0, 1] (0: off), got {self.min_p!r}")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= MAX_TOKEN_ID:
            raise ValueError(f"top_k: must be -1 (off), 0 (off) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"seed: must be an integer in [0, 2**64 - 1], got {self.seed!r}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        bad = [t for t in self.stop_token_ids if not _is_int(t) or not 0 <= t <= MAX_TOKEN_ID]
        if bad:
            raise ValueError(f"stop_token_ids: must be token ids in [0, 2**31 - 1], got {bad[:5]}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens:
            raise ValueError(f"min_tokens: must be an integer >= 0, got {self.min_tokens!r}")
        if _is_int(self.max_new_tokens) and self.min_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_tokens: must be at most max_new_tokens ({self.max_new_tokens}), got {self.min_tokens!r}"
            )
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name}: must be a number in [-2, 2] (0: off), got {value!r}")
        rep = self.repetition_penalty
        if not _is_real(rep) or not MIN_REPETITION_PENALTY <= rep <= MAX_REPETITION_PENALTY:
            raise ValueError(
                f"repetition_penalty: must be a number in [{MIN_REPETITION_PENALTY:g}, "
                f"{MAX_REPETITION_PENALTY:g}] (1: off), got {rep!r}"
            )
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(self.logit_bias)}")
        bad = [t for t, _ in self.logit_bias if not _is_int(t) or not 0 <= t <= MAX_TOKEN_ID]
        if bad:
            raise ValueError(f"logit_bias: keys must be token ids in [0, 2**31 - 1], got {bad[:5]}")
        bad = [b for _, b in self.logit_bias if not _is_real(b) or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS]
        if bad:
            raise ValueError(f"logit_bias: biases must be numbers in [-100, 100], got {bad[:5]}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name}: must be null (none) or an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        for name in ("ignore_eos", "return_logits"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be true or false, got {getattr(self, name)!r}")
        if self.structured_outputs is not None:
            self.structured_outputs.validate()

    def vocabulary_problem(self, vocab_size: int) -> str | None:
        """What names a token id outside [0, vocab_size) (a message naming the field), or None."""
        bad = [t for t, _ in self.logit_bias if t >= vocab_size]
        if bad:
            return f"logit_bias: token ids {bad[:5]} outside the vocabulary [0, {vocab_size})"
        return None


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice `index` of n of a request seeded `seed`: seed + index, as vLLM forks
    one (wrapped to 64 bits); None stays None (each choice draws its own)."""
    return None if seed is None else (seed + index) % (MAX_SEED + 1)


def _bias_pairs(bias: object) -> tuple[tuple[int, float], ...]:
    """A logit bias as (token id, bias) pairs in id order: from a mapping, pairs, or None (none).
    Values are checked by `validate`; only the shape is checked here."""
    if bias is None:
        return ()
    items = bias.items() if isinstance(bias, Mapping) else bias
    if isinstance(items, (str, bytes)) or not hasattr(items, "__iter__"):
        raise ValueError(f"logit_bias: must map token ids to biases, got {_short(bias)}")
    pairs = []
    for item in items:
        if isinstance(item, (str, bytes)) or not hasattr(item, "__len__") or len(item) != 2:
            raise ValueError(f"logit_bias: must map token ids to biases, got {_short(bias)}")
        pairs.append((item[0], item[1]))
    if all(_is_int(t) for t, _ in pairs):  # otherwise `validate` names the key
        if len({t for t, _ in pairs}) != len(pairs):
            raise ValueError(f"logit_bias: a token id is given twice in {_short(bias)}")
        pairs.sort(key=lambda pair: pair[0])
    return tuple(pairs)


def _short(value: object) -> str:
    """A client's value as a message quotes it: at most 64 characters."""
    text = repr(value)
    return text if len(text) <= 64 else text[:61] + "..."


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
