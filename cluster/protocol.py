"""The generation request both front doors accept, validated once, before any work is done.

The gRPC servicer turns its message into the same dict an HTTP client posts; `parse_request`
checks every field's type, range and size (strict: no string for a number, no bool for an
integer, no NaN or infinity), so that a malformed request is answered at once with a message
naming the field, before it is tokenized, routed or queued. `PromptLimits` bounds what a
prompt may cost before it is tokenized: a text of more characters than the context can hold
tokens of the longest vocabulary entry cannot fit, whatever it tokenizes to.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from workers.sampling_params import SamplingParams

MAX_ID_CHARS = 256  # request_id, session_id
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024

StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


class InvalidRequest(ValueError):
    """A request that can never be served as sent; the message names the field."""


class SamplingBody(BaseModel):
    """Sampling fields; unset ones take `SamplingParams`' defaults."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_new_tokens: int | None = None
    seed: int | None = None
    ignore_eos: bool | None = None
    stop: list[StopString] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    stop_token_ids: list[int] = Field(default_factory=list, max_length=1024)

    def params(self) -> SamplingParams:
        """The engine's sampling parameters, range-checked (InvalidRequest names the field)."""
        fields = self.model_dump(exclude_none=True, exclude={"stop"})
        params = SamplingParams(**fields)
        try:
            params.validate()
        except ValueError as exc:
            raise InvalidRequest(f"sampling.{exc}") from None
        return params


class GenerateBody(BaseModel):
    """What a client sends: `prompt` (text) or `prompt_token_ids`, sampling, routing keys."""

    model_config = ConfigDict(extra="forbid", strict=True)

    request_id: str | None = Field(None, min_length=1, max_length=MAX_ID_CHARS)
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    sampling: SamplingBody = Field(default_factory=SamplingBody)
    session_id: str | None = Field(None, max_length=MAX_ID_CHARS)


class RoutedBody(GenerateBody):
    """What the ingress sends a replica: a validated body plus what the ingress adds."""

    trace_context: dict[str, str] | None = None
    exclude_replicas: list[str] = Field(default_factory=list)


@dataclasses.dataclass
class ParsedRequest:
    body: GenerateBody
    sampling: SamplingParams
    stop: list[str]

    @property
    def request_id(self) -> str | None:
        return self.body.request_id


def parse_request(body: Any, model: type[GenerateBody] = GenerateBody) -> ParsedRequest:
    """Validate a request dict; InvalidRequest names the first offending field."""
    if not isinstance(body, dict):
        raise InvalidRequest(f"request: must be a JSON object, got {type(body).__name__}")
    try:
        parsed = model.model_validate(body)
    except ValidationError as exc:
        raise InvalidRequest(_describe(exc)) from None
    if (parsed.prompt is None) == (parsed.prompt_token_ids is None):
        raise InvalidRequest("prompt / prompt_token_ids: give exactly one of them")
    return ParsedRequest(parsed, parsed.sampling.params(), list(parsed.sampling.stop))


def _describe(exc: ValidationError) -> str:
    """`field.path[i]: what is wrong` for the first error, without pydantic's URL and input echo."""
    error = exc.errors(include_url=False, include_input=False)[0]
    path = ""
    for part in error["loc"]:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    if error["type"] == "extra_forbidden":
        return f"{path or 'request'}: unknown field"
    if error["type"] in ("model_type", "model_attributes_type", "dict_type"):
        return f"{path or 'request'}: must be an object"
    return f"{path or 'request'}: {error['msg']}"


@dataclasses.dataclass(frozen=True)
class PromptLimits:
    """What a prompt may be before it is tokenized or queued."""

    context_length: int  # tokens; a prompt must leave room for one new token
    max_token_chars: int  # characters of the longest vocabulary entry (an upper bound per token)

    @classmethod
    def of(cls, context_length: int, tokenizer) -> PromptLimits:
        longest = max((len(t) for t in tokenizer.get_vocab()), default=1) if tokenizer is not None else 1
        return cls(context_length, max(1, longest))

    @property
    def max_prompt_chars(self) -> int:
        return self.context_length * self.max_token_chars

    def check_text(self, prompt: str) -> None:
        if len(prompt) > self.max_prompt_chars:
            raise InvalidRequest(
                f"prompt: {len(prompt)} characters cannot fit the context length of {self.context_length} tokens "
                f"(at most {self.max_prompt_chars} characters with this tokenizer)"
            )

    def check_ids(self, count: int, field: str = "prompt_token_ids") -> None:
        if count >= self.context_length:
            raise InvalidRequest(
                f"{field}: prompt of {count} tokens leaves no room in the context length {self.context_length}"
            )


def check_sizes(body: dict[str, Any], limits: PromptLimits) -> None:
    """The cheap size checks, before the body is validated field by field."""
    prompt, ids = body.get("prompt"), body.get("prompt_token_ids")
    if isinstance(prompt, str):
        limits.check_text(prompt)
    if isinstance(ids, list):
        limits.check_ids(len(ids))
