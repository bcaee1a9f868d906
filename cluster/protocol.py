"""The generation request and response of both front doors: one model, rendered on each.

The model is the `slidespec.v1` proto. An HTTP client posts a `GenerateRequest` as JSON (the
same field names) and reads `GenerateResponse`s as JSON lines (the proto3 JSON mapping); the
gRPC servicer turns its message into the same dict an HTTP client posts. `parse_request`
checks every field's type, range and size (strict: no string for a number, no bool for an
integer, no NaN or infinity), so that a malformed request is answered at once with a message
naming the field, before it is tokenized, routed or queued. `PromptLimits` bounds what a
prompt may cost before it is tokenized: a text of more characters than the context can hold
tokens of the longest vocabulary entry cannot fit, whatever it tokenizes to.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

from google.protobuf import json_format
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import PydanticCustomError

from cluster.proto.slidespec.v1 import generation_pb2 as pb
from workers.sampling_params import MAX_LOGIT_BIAS_ENTRIES, SamplingParams
from workers.tokenizer import unicode_problem

MAX_ID_CHARS = 256  # request_id, session_id
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
MAX_FIELD_CHARS = 64  # of a client's text quoted back in an error (an unknown field's name, a value)
MAX_CHOICES = 128  # OpenAI's limit on n


def _encodable(text: str) -> str:
    if (problem := unicode_problem(text)) is not None:
        raise PydanticCustomError("unicode", problem)
    return text


Text = Annotated[str, AfterValidator(_encodable)]
StopString = Annotated[Text, Field(min_length=1, max_length=MAX_STOP_CHARS)]


class InvalidRequest(ValueError):
    """A request that can never be served as sent; the message names the field."""


class StructuredOutputsBody(BaseModel):
    """vLLM's `structured_outputs`: set exactly one (`workers.grammar.StructuredOutputs` checks
    them; a JSON schema may be an object or its text)."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_by_name=True, serialize_by_alias=True)

    json_schema: str | dict[str, Any] | None = Field(None, alias="json")  # `json` would shadow BaseModel's
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: bool | None = None


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
    structured_outputs: StructuredOutputsBody | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    # token id (decimal text: JSON keys are strings, as OpenAI sends them) -> added to its logit
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS_ENTRIES)
    logprobs: int | None = None  # each new token's logprob and this many most likely tokens'
    prompt_logprobs: int | None = None  # the same for each prompt token after the first
    n: int = Field(1, ge=1, le=MAX_CHOICES)  # choices of the prompt, each its own request (`choices`)

    def params(self) -> SamplingParams:
        """The engine's sampling parameters, range-checked (InvalidRequest names the field)."""
        fields = self.model_dump(exclude_none=True, exclude={"stop", "n"})
        if self.logit_bias is not None:
            fields["logit_bias"] = _token_keys(self.logit_bias, "sampling.logit_bias")
        try:
            params = SamplingParams(**fields)
            params.validate()
        except ValueError as exc:
            raise InvalidRequest(f"sampling.{exc}") from None
        return params


class GenerateBody(BaseModel):
    """What a client sends: `prompt` (text) or `prompt_token_ids`, sampling, routing keys."""

    model_config = ConfigDict(extra="forbid", strict=True)

    request_id: Text | None = Field(None, min_length=1, max_length=MAX_ID_CHARS)
    prompt: Text | None = None
    prompt_token_ids: list[int] | None = None
    sampling: SamplingBody = Field(default_factory=SamplingBody)
    session_id: Text | None = Field(None, max_length=MAX_ID_CHARS)
    stream: bool = True  # false: one response at the end


class RoutedBody(GenerateBody):
    """What the ingress sends a replica: a validated body plus what the ingress adds."""

    trace_context: dict[str, str] | None = None
    exclude_replicas: list[str] = Field(default_factory=list)
    follows: str | None = None  # another choice of the same prompt (`cluster.gateway.choices`)


@dataclasses.dataclass
class ParsedRequest:
    body: GenerateBody
    sampling: SamplingParams
    stop: list[str]

    @property
    def request_id(self) -> str | None:
        return self.body.request_id


def _token_keys(mapping: dict[str, float], field: str) -> dict[int, float]:
    """A JSON object keyed by token ids (decimal text) as a mapping keyed by int."""
    out = {}
    for key, value in mapping.items():
        if not key.isdecimal() or len(key) > 10:
            raise InvalidRequest(f"{field}: keys must be token ids (decimal integers), got {clipped(repr(key))}")
        out[int(key)] = value
    return out


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


def clipped(text: str) -> str:
    """A client's text quoted back in an error, cut to `MAX_FIELD_CHARS`."""
    return text if len(text) <= MAX_FIELD_CHARS else text[:MAX_FIELD_CHARS] + "..."


def _describe(exc: ValidationError) -> str:
    """`field.path[i]: what is wrong` for the first error, without pydantic's URL and input echo."""
    error = exc.errors(include_url=False, include_input=False)[0]
    path = ""
    for part in error["loc"]:
        if isinstance(part, str):  # an unknown key is the client's text
            part = clipped(part)
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


# -- the gRPC message <-> the request dict --------------------------------------------------------
FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "max_new_tokens",
    "seed",
    "ignore_eos",
    "min_p",
    "min_tokens",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "logprobs",
    "prompt_logprobs",
    "n",
)


def request_to_body(request: pb.GenerateRequest) -> dict[str, Any]:
    """The request dict both doors validate: only the fields that are set."""
    body: dict[str, Any] = {}
    if request.HasField("prompt"):
        body["prompt"] = request.prompt
    if request.prompt_token_ids:
        body["prompt_token_ids"] = list(request.prompt_token_ids)
    if request.request_id:
        body["request_id"] = request.request_id
    if request.session_id:
        body["session_id"] = request.session_id
    if request.HasField("stream"):
        body["stream"] = request.stream
    s = request.sampling
    sampling: dict[str, Any] = {name: getattr(s, name) for name in SAMPLING_FIELDS if s.HasField(name)}
    if s.stop:
        sampling["stop"] = list(s.stop)
    if s.stop_token_ids:
        sampling["stop_token_ids"] = list(s.stop_token_ids)
    if s.logit_bias:
        sampling["logit_bias"] = {str(token): bias for token, bias in s.logit_bias.items()}
    if s.HasField("structured_outputs"):
        kind = s.structured_outputs.WhichOneof("kind")
        value = getattr(s.structured_outputs, kind) if kind else None
        sampling["structured_outputs"] = {kind: list(value.values) if kind == "choice" else value} if kind else {}
    if sampling:
        body["sampling"] = sampling
    return body


def update_to_response(update: dict[str, Any]) -> pb.GenerateResponse:
    """A replica's update as the response both doors send (internal fields such as the
    replica's load are not part of it)."""
    response = pb.GenerateResponse(
        request_id=update.get("request_id", ""),
        token_ids=update["token_ids"],
        text=update.get("text", ""),
        finished=update["finished"],
        replica=update.get("replica", ""),
        index=update.get("index", 0),
    )
    for field in ("logprobs", "prompt_logprobs"):
        if update.get(field) is not None:
            getattr(response, field).CopyFrom(_logprobs_message(update[field]))
    if update["finished"]:
        response.finish_reason = FINISH_REASONS.get(update.get("finish_reason"), pb.FINISH_REASON_UNSPECIFIED)
        response.usage.prompt_tokens = update.get("prompt_tokens", 0)
        response.usage.completion_tokens = update.get("completion_tokens", 0)
        response.usage.cached_tokens = update.get("cached_tokens", 0)
        spec = update.get("spec")
        if spec:
            response.spec.CopyFrom(
                pb.SpecStats(
                    verify_steps=spec["verify_steps"],
                    mean_accept_length=spec["mean_accept_length"],
                    accepted_per_position=spec["accepted_per_position"],
                    accept_lengths=spec["accept_lengths"],
                )
            )
    return response


def _logprobs_message(logprobs: dict[str, list]) -> pb.Logprobs:
    """A wire update's logprobs (`workers.logprobs.Logprobs` as a dict) as the proto message."""
    return pb.Logprobs(
        token_logprobs=logprobs["token"],
        top=[pb.TopLogprobs(token_ids=i, logprobs=v) for i, v in zip(logprobs["top_ids"], logprobs["top"])],
        ranks=logprobs["rank"],
    )


def merge_responses(responses: list[pb.GenerateResponse]) -> list[pb.GenerateResponse]:
    """The responses of a non-streaming call, one per choice in choice order: its every token
    (and their logprobs), its whole text, its end."""
    merged: dict[int, pb.GenerateResponse] = {}
    for response in responses:
        whole = merged.get(response.index)
        if whole is None:
            merged[response.index] = whole = pb.GenerateResponse()
            whole.CopyFrom(response)
            continue
        tokens, text = list(whole.token_ids) + list(response.token_ids), whole.text + response.text
        logprobs, prompt = pb.Logprobs(), pb.Logprobs()
        logprobs.CopyFrom(whole.logprobs)
        logprobs.MergeFrom(response.logprobs)
        prompt.CopyFrom(whole.prompt_logprobs if whole.HasField("prompt_logprobs") else response.prompt_logprobs)
        whole.CopyFrom(response)
        del whole.token_ids[:]
        whole.token_ids.extend(tokens)
        whole.text = text
        for field, value in (("logprobs", logprobs), ("prompt_logprobs", prompt)):
            if value.token_logprobs:
                getattr(whole, field).CopyFrom(value)
    return [merged[i] for i in sorted(merged)]


def response_json(response: pb.GenerateResponse) -> dict[str, Any]:
    """The HTTP rendering of a response: its proto3 JSON mapping with the proto's field names
    (every field present, so `finished` and `token_ids` are on every line)."""
    return json_format.MessageToDict(
        response, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


def error_json(code: str, message: str) -> dict[str, Any]:
    """An error on the HTTP door: the gRPC status name and the same message gRPC would send."""
    return {"error": {"code": code, "message": message}}
