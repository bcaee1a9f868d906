"""The OpenAI-compatible HTTP API on the ingress, beside gRPC and the JSON-lines route.

`POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models` and `GET /v1/models/{model}`
(paths of `cluster/http_routes.py`), streaming as
server-sent events (`data: {...}` chunks, then `data: [DONE]`). A request becomes the generation
API's body and goes through the same gateway (validation, routing, retries), engine, metrics and
traces as the other doors; chat messages are rendered with the model's own chat template
(transformers). Errors take OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`.
Parameters OpenAI defines that the engine does not implement are accepted at their neutral value
and refused otherwise, naming the parameter; fields nobody defines are ignored, as OpenAI does.

`n` choices of a prompt are `n` requests of the generation API (`cluster.gateway.choices`: the
replica prefills the prompt once and forks it); `usage` counts each prompt once, as OpenAI does.
Log-probabilities take OpenAI's shapes (`cluster/openai_logprobs.py`); `echo` with `logprobs`
gives the prompt's, and `max_tokens: 0` with `echo` the prompt alone (lm-evaluation-harness's
loglikelihood requests). Tool calls are forced by a grammar (`cluster/openai_structured.py`) or,
with `tool_choice: "auto"`, parsed out of the model's text (`cluster/openai_tools.py`).
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, PrivateAttr, ValidationError
from starlette.responses import JSONResponse, StreamingResponse

from cluster import openai_logprobs
from cluster.gateway import STATUS, Gateway, RequestFailed, merge_streams
from cluster.http_api import BodyTooLarge, read_json
from cluster.openai_structured import Refused, Structured, ToolCalls, structured_outputs
from cluster.openai_tools import AutoTools, ToolCallParser, ToolFormat
from cluster.protocol import InvalidRequest, clipped
from cluster.telemetry import READER_GONE, RequestTelemetry
from workers.error_codes import ErrorCode
from workers.tokenizer import unicode_problem

COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for completions; chat defaults to the rest of the context
# parameter -> the values that mean "off" (anything else is refused: not implemented)
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""),
    "functions": (None, []),
}
# the generation API's field -> the OpenAI parameter it came from (the prompt's and the session's
# depend on the route and the request: `_prepare` names them)
PARAMS = {"max_new_tokens": "max_tokens"}
FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    error = {"message": message, "type": ERROR_TYPES.get(status, "api_error"), "param": param, "code": code}
    return JSONResponse({"error": error}, status_code=status)


class StreamOptions(BaseModel):
    include_usage: bool = False


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: passed to the template
    role: str
    content: str | list[dict[str, Any]] | None = None


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool | None = None  # vLLM's extension
    return_token_ids: bool = False  # vLLM's extension: each choice (chunk) also carries its token ids
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extension, as the next three
    min_tokens: int | None = None
    min_p: float | None = None
    prompt_logprobs: int | None = None  # each choice carries its prompt's logprobs, in vLLM's shape
    logit_bias: dict[str, float] | None = None  # token id (decimal text) -> added to its logit
    stop_token_ids: list[int] | None = None  # vLLM's extension
    best_of: int | None = None  # as vLLM: none, or n
    # response_format, structured_outputs, guided_*, tools and tool_choice (cluster/openai_structured.py)
    _structured: Structured = PrivateAttr(default_factory=Structured)

    def sampling(self) -> dict[str, Any]:
        values = {
            "max_new_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "ignore_eos": self.ignore_eos,
            "stop": [self.stop] if isinstance(self.stop, str) else self.stop,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "repetition_penalty": self.repetition_penalty,
            "min_tokens": self.min_tokens,
            "min_p": self.min_p,
            "stop_token_ids": self.stop_token_ids,
            "logit_bias": self.logit_bias or None,
            "logprobs": self.token_logprobs,
            "prompt_logprobs": self.prompt_logprobs,
            "n": self.n if self.n != 1 else None,
        }
        return {k: v for k, v in values.items() if v is not None}

    @property
    def token_logprobs(self) -> int | None:
        """How many most likely tokens each new token's logprobs show (None: no logprobs)."""
        return None

    @property
    def names(self) -> dict[str, str]:
        """The generation API's fields named as this request's parameters, for its errors (the
        replica's refusals too: a logit_bias key outside the vocabulary)."""
        return {"logit_bias": "logit_bias"} if self.logit_bias else {}


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False

    @property
    def token_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def echo_only(self) -> bool:
        """`max_tokens: 0` with `echo`: the prompt (and its logprobs) alone, nothing generated."""
        return self.echo and self.max_tokens == 0

    def sampling(self) -> dict[str, Any]:
        values = super().sampling()
        if self.echo and self.logprobs is not None and self.prompt_logprobs is None:
            values["prompt_logprobs"] = self.logprobs
        if self.echo_only:  # one token is drawn (the prefill's own) and not shown
            values["max_new_tokens"] = 1
        return values

    @property
    def names(self) -> dict[str, str]:
        echoed = {} if self.prompt_logprobs is not None or not self.echo else {"prompt_logprobs": "logprobs"}
        return {**super().names, **echoed}


class ChatRequest(_Request):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    @property
    def token_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def names(self) -> dict[str, str]:
        return {**super().names, "logprobs": "top_logprobs"}


def _parse(model: type[_Request], body: Any, tool_format: ToolFormat | None = None) -> _Request:
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        error = exc.errors(include_url=False, include_input=False)[0]
        param = str(error["loc"][0]) if error["loc"] else None
        where = ".".join(str(part) for part in error["loc"])
        raise OpenAIError(400, f"{where}: {error['msg']}", param) from None
    for param, neutral in NEUTRAL.items():
        value = (request.model_extra or {}).get(param)
        if value not in neutral:
            raise OpenAIError(400, f"{param}: not supported by this server (got {clipped(repr(value))})", param)
    if request.best_of is not None and request.best_of != request.n:
        raise OpenAIError(
            400, f"best_of: must be null or equal to n ({request.n}), got {clipped(repr(request.best_of))}", "best_of"
        )
    if isinstance(request, ChatRequest) and request.top_logprobs is not None and not request.logprobs:
        raise OpenAIError(400, "top_logprobs: needs logprobs to be true", "top_logprobs")
    try:
        request._structured = structured_outputs(request.model_extra or {}, model is ChatRequest, tool_format)
    except Refused as exc:
        raise OpenAIError(400, str(exc), exc.param) from None
    return request


def _names(parsed: _Request) -> dict[str, str]:
    """The OpenAI parameters the generation API's fields came from, for this request's errors:
    its structured outputs' and its logprobs'."""
    source = parsed._structured.source
    return {**parsed.names, **({"structured_outputs": source} if source else {})}


def _openai_message(message: str, names: dict[str, str]) -> tuple[str, str]:
    """The gateway's `field: what` message in OpenAI's names, `names` (this request's) first:
    (message, param)."""
    field, _, what = message.partition(": ")
    name = field.removeprefix("sampling.").split("[")[0].split(" ")[0].split(".")[0]
    param = names.get(name) or PARAMS.get(name, name)
    return f"{param}: {what}" if what else message, param


class OpenAIApi:
    def __init__(
        self,
        gateway: Gateway,
        telemetry: Callable[[dict[str, Any], Mapping[str, str], tuple[str, int]], RequestTelemetry],
        tokenizer,
        model_name: str,
        max_request_bytes: int,
        tool_format: ToolFormat | None = None,
    ) -> None:
        """`tool_format`: how the model writes tool calls of its own (None: `tool_choice: "auto"`
        is refused)."""
        self.gateway = gateway
        self.tool_format = tool_format
        self.telemetry = telemetry
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_request_bytes = max_request_bytes
        self.created = int(time.time())

    async def completions(self, request, chat: bool) -> Any:
        """`POST /v1/completions` (chat: `POST /v1/chat/completions`)."""
        try:
            try:
                body = await read_json(request, self.max_request_bytes)
            except BodyTooLarge as exc:
                raise OpenAIError(413, str(exc)) from None
            except InvalidRequest as exc:
                raise OpenAIError(400, str(exc)) from None
            parsed = _parse(ChatRequest if chat else CompletionRequest, body, self.tool_format)
            self._served(parsed.model)
            return await self._complete(parsed, chat, request)
        except OpenAIError as exc:
            if exc.status in (400, 413):
                self.gateway.rejected("OpenAI", exc)
            return error_response(exc.status, exc.message, exc.param, exc.code)

    def models(self) -> JSONResponse:
        """`GET /v1/models`: the one model this application serves."""
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    def model(self, name: str) -> JSONResponse:
        """`GET /v1/models/{model}`: its card, or 404 for a model this application does not serve."""
        try:
            self._served(name)
        except OpenAIError as exc:
            return error_response(exc.status, exc.message, exc.param, exc.code)
        return JSONResponse(self._model_card())

    def _served(self, name: str) -> None:
        if name != self.model_name:
            raise OpenAIError(
                404,
                f"model {clipped(repr(name))} does not exist; this server serves {self.model_name!r}",
                "model",
                "model_not_found",
            )

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "slidespec",
            "max_model_len": self.gateway.limits.context_length,
        }

    # -- requests -----------------------------------------------------------------------------------
    def _prompts(self, parsed: _Request, chat: bool) -> list[dict[str, Any]]:
        """The prompt fields of each choice's generation request."""
        if chat:
            return [{"prompt_token_ids": self._render(parsed)}]
        prompt = parsed.prompt
        if isinstance(prompt, str):
            return [{"prompt": prompt}]
        if prompt and all(isinstance(p, int) for p in prompt):
            return [{"prompt_token_ids": prompt}]
        if not prompt:
            raise OpenAIError(400, "prompt: must not be empty", "prompt")
        return [{"prompt": p} if isinstance(p, str) else {"prompt_token_ids": p} for p in prompt]

    def _render(self, parsed: ChatRequest) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise OpenAIError(400, f"messages: the model {self.model_name!r} has no chat template", "messages")
        messages = [m.model_dump(exclude_none=True) for m in parsed.messages]
        tools = {"tools": parsed._structured.template_tools} if parsed._structured.template_tools else {}
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **tools)
        except Exception as exc:  # noqa: BLE001 - the template's own complaint, e.g. roles out of order
            raise OpenAIError(400, f"messages: the chat template refused them: {exc}", "messages") from None
        if (problem := unicode_problem(text)) is not None:
            raise OpenAIError(400, f"messages: {problem}", "messages")
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def _prepare(
        self, parsed: _Request, chat: bool, prompt: dict[str, Any], session: tuple[str, str] | None
    ) -> dict[str, Any]:
        """One choice's generation request, validated; `session` is (where it came from, the
        consistent-hash key)."""
        sampling = parsed.sampling()
        if chat and parsed.max_completion_tokens is not None:
            sampling["max_new_tokens"] = parsed.max_completion_tokens
        if not chat:
            sampling.setdefault("max_new_tokens", COMPLETIONS_MAX_TOKENS)
        if parsed._structured.spec is not None:
            sampling["structured_outputs"] = parsed._structured.spec
        body = {**prompt, "sampling": sampling, "stream": True}
        if session is not None:
            body["session_id"] = session[1]
        try:
            routed = await self.gateway.prepare(body, "OpenAI")
        except InvalidRequest as exc:
            door = "messages" if chat else "prompt"
            names = {"prompt": door, "prompt_token_ids": door, "request": door, **_names(parsed)}
            if session is not None:
                names["session_id"] = session[0]
            message, param = _openai_message(str(exc), names)
            raise OpenAIError(400, message, param) from None
        room = self.gateway.limits.context_length - len(routed["prompt_token_ids"])
        if "max_new_tokens" not in sampling:  # chat: the rest of the context
            routed["sampling"]["max_new_tokens"] = room
        elif sampling["max_new_tokens"] > room:  # as vLLM: refused, not cut short
            raise OpenAIError(
                400,
                f"max_tokens: {sampling['max_new_tokens']} new tokens after a prompt of "
                f"{len(routed['prompt_token_ids'])} exceed the context length of {self.gateway.limits.context_length}",
                "max_tokens",
            )
        return routed

    async def _complete(self, parsed: _Request, chat: bool, request) -> Any:
        headers = dict(request.headers)
        session = ("user", parsed.user) if parsed.user else None
        if session is None and headers.get("x-session-id"):
            session = ("x-session-id", headers["x-session-id"])
        prompts = self._prompts(parsed, chat)
        routed = [await self._prepare(parsed, chat, p, session) for p in prompts]
        server = (request.url.hostname or "", request.url.port or 0)
        calls = [(r, self.telemetry(r, headers, server)) for r in routed]
        shown = [_Shown(r["prompt_token_ids"], p.get("prompt")) for r, p in zip(routed, prompts)]
        response = _Response(chat, self.model_name, parsed, shown, openai_logprobs.TokenText(self.tokenizer))
        events = merge_streams([_ended(self.gateway.generate(r, t), t) for r, t in calls])
        try:  # the first update before the answer starts: a failure until then has its own status
            first = await events.__anext__()
            if parsed.stream:
                return StreamingResponse(response.stream(first, events), media_type="text/event-stream")
            response.feed(*first)
            async for index, update in events:
                response.feed(index, update)
            response.drain()
        except RequestFailed as failed:
            await events.aclose()
            status = STATUS.get(failed.code, STATUS[ErrorCode.INTERNAL.value])[1]
            names = _names(parsed)  # a grammar that did not compile is named as the client sent it
            field = failed.message.partition(": ")[0].split(".")[0]
            message, param = _openai_message(failed.message, names) if field in names else (failed.message, None)
            return error_response(status, message, param, code=failed.code)
        return JSONResponse(response.whole())


async def _ended(updates: AsyncIterator[dict[str, Any]], telemetry: RequestTelemetry) -> AsyncIterator[dict[str, Any]]:
    """A choice's updates, its telemetry ended however the stream ends."""
    outcome: str | None = None
    try:
        async for update in updates:
            yield update
    except RequestFailed as failed:
        telemetry.end(failed.code, failed.message)
        outcome = "reported"
        raise
    except READER_GONE:
        outcome = "cancelled"
        raise
    finally:
        await updates.aclose()
        if outcome != "reported":
            telemetry.end(outcome)


@dataclasses.dataclass
class _Shown:
    """A prompt as `echo` shows it: its tokens, and its text (None: decoded from them)."""

    ids: list[int]
    text: str | None


class _Response:
    """Builds the OpenAI objects of one request: chunks while streaming, or the whole object.
    Choice `p * n + j` is choice j of prompt p. A choice that shows its prompt's logprobs (echo,
    vLLM's prompt_logprobs) takes them from its prompt's choice 0 (only it asks: `choices`), so
    its updates wait here until choice 0's first update has brought them."""

    def __init__(
        self, chat: bool, model: str, parsed: _Request, prompts: list[_Shown], token_text: openai_logprobs.TokenText
    ) -> None:
        self.chat = chat
        self.n = parsed.n
        choices = len(prompts) * self.n
        self.prompts = prompts
        self.token_text = token_text
        self.echo = not chat and parsed.echo
        self.echo_only = not chat and parsed.echo_only
        self.logprobs = parsed.token_logprobs is not None
        self.shows_prompt_logprobs = parsed.prompt_logprobs is not None
        self.token_ids: list[list[int]] | None = [[] for _ in range(choices)] if parsed.return_token_ids else None
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.model = model
        self.created = int(time.time())
        self.include_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
        self.text = [""] * choices
        self.lp: list[Any] = [None if not self.logprobs else [] if chat else None for _ in range(choices)]
        self.offset = [0] * choices  # text_offset of each choice's next token
        self.started = [False] * choices  # recorded an update
        self.shown_once = [False] * choices  # streamed a chunk
        self.held: list[list[dict[str, Any]]] = [[] for _ in range(choices)]
        self.prompt_lp: list[dict[str, list] | None] = [None] * len(prompts)  # from each prompt's choice 0
        self.finish: list[str | None] = [None] * choices
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
        self.spec: list[dict[str, Any]] = []
        self.tools: ToolCalls | None = parsed._structured.tools  # chat output carried as tool calls
        self.auto: AutoTools | None = parsed._structured.auto  # chat tool calls to find in the text
        self.parsers: list[ToolCallParser] = [self.auto.parser() for _ in range(choices)] if self.auto else []
        self.calls_sent = [0] * choices  # tool calls a stream sent, per choice

    def feed(self, prompt: int, update: dict[str, Any]) -> list[tuple[int, dict[str, Any], str, Any]]:
        """Take one update of a prompt's choices; returns what is ready to show, in order:
        (choice, update, its text, its logprobs)."""
        if update.get("prompt_logprobs") is not None:
            self.prompt_lp[prompt] = update["prompt_logprobs"]
        self.held[prompt * self.n + update.get("index", 0)].append(update)
        return [self._take(c) for c in range(len(self.held)) for _ in range(len(self.held[c])) if self._ready(c)]

    def drain(self) -> list[tuple[int, dict[str, Any], str, Any]]:
        """Whatever still waits (its prompt's logprobs never came: shown without them)."""
        return [self._take(c) for c in range(len(self.held)) for _ in range(len(self.held[c]))]

    def _ready(self, choice: int) -> bool:
        wants = (self.echo and self.logprobs) or self.shows_prompt_logprobs
        return not wants or self.prompt_lp[choice // self.n] is not None

    def _take(self, choice: int) -> tuple[int, dict[str, Any], str, Any]:
        update = self.held[choice].pop(0)
        text, lp = self._add(choice, update)
        return choice, update, text, lp

    def _add(self, i: int, update: dict[str, Any]) -> tuple[str, Any]:
        """Record an update of choice i; returns the text and logprobs it adds (with echo, the
        prompt's before the first)."""
        ids, text = update["token_ids"], update.get("text", "")
        if self.echo_only:
            ids, text = [], ""
        lp: Any = None
        if not self.started[i] and self.echo:
            shown = self.prompts[i // self.n]
            text = (shown.text if shown.text is not None else self.token_text.decode(shown.ids)) + text
            if self.logprobs:
                lp = openai_logprobs.completion(self.prompt_lp[i // self.n], shown.ids, self.token_text, 0, True)
                self.offset[i] = sum(len(t) for t in lp["tokens"])
        self.started[i] = True
        if self.logprobs and self.chat:
            lp = openai_logprobs.chat(update.get("logprobs"), ids, self.token_text)
            self.lp[i] += lp
        elif self.logprobs:
            own = openai_logprobs.completion(update.get("logprobs"), ids, self.token_text, self.offset[i])
            self.offset[i] += sum(len(t) for t in own["tokens"])
            lp = openai_logprobs.join_completion(lp, own)
            self.lp[i] = openai_logprobs.join_completion(self.lp[i], lp)
        self.text[i] += text
        if self.token_ids is not None:
            self.token_ids[i] += ids
        if update["finished"]:
            reason = "length" if self.echo_only else update.get("finish_reason")
            self.finish[i] = FINISH.get(reason, reason)
            counted = ("completion_tokens",) if i % self.n else tuple(self.usage)  # each prompt once
            for key in counted:
                self.usage[key] += 0 if self.echo_only and key == "completion_tokens" else update.get(key, 0)
            if update.get("spec"):
                self.spec.append({"index": i, **update["spec"]})
        return text, lp

    def _prompt_logprobs(self, i: int) -> list[Any]:
        """vLLM's prompt_logprobs of choice i's prompt."""
        shown, lp = self.prompts[i // self.n], self.prompt_lp[i // self.n]
        return openai_logprobs.prompt(lp, shown.ids, self.token_text) if lp is not None else None

    def _usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.usage["prompt_tokens"],
            "completion_tokens": self.usage["completion_tokens"],
            "total_tokens": self.usage["prompt_tokens"] + self.usage["completion_tokens"],
            "prompt_tokens_details": {"cached_tokens": self.usage["cached_tokens"]},
        }

    def _object(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def _logprobs_field(self, lp: Any) -> Any:
        if not self.logprobs:
            return None
        return {"content": lp or []} if self.chat else lp

    def whole(self) -> dict[str, Any]:
        choices = []
        for i, (text, finish) in enumerate(zip(self.text, self.finish)):
            body = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
            calls = self._tool_calls(i)
            if calls is not None:
                body["message"] = {"role": "assistant", "content": None, "tool_calls": calls}
                finish = self.tools.finish_reason
            elif self.auto is not None:
                content, calls = self.auto.parse(text)
                if calls:
                    body["message"] = {"role": "assistant", "content": content or None, "tool_calls": calls}
                    finish = "tool_calls"
            choices.append({"index": i, **body, "logprobs": self._logprobs_field(self.lp[i]), "finish_reason": finish})
            if self.shows_prompt_logprobs:
                choices[-1]["prompt_logprobs"] = self._prompt_logprobs(i)
            if self.token_ids is not None:
                choices[-1]["token_ids"] = self.token_ids[i]
        out = {**self._object(choices, chunk=False), "usage": self._usage()}
        if self.spec:
            out["speculative"] = self.spec  # accept lengths per choice (an extension)
        return out

    def _tool_calls(self, index: int) -> list[dict[str, Any]] | None:
        """The choice's tool calls, once it finished as its grammar ends (None otherwise)."""
        if self.tools is None or self.finish[index] != "stop":
            return None
        return self.tools.calls(self.text[index])

    def _chunk(
        self,
        index: int,
        text: str | None,
        finish: str | None,
        role: bool = False,
        ids: list[int] | None = None,
        lp: Any = None,
        first: bool = False,
    ) -> str:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            calls = self._tool_calls(index) if finish else None
            if self.auto is not None and not role:  # content outside calls, and each call once complete
                text, made = self.parsers[index].feed(text or "", final=finish is not None)
                if made:
                    delta["tool_calls"] = [{"index": self.calls_sent[index] + j, **c} for j, c in enumerate(made)]
                    self.calls_sent[index] += len(made)
                if finish and self.calls_sent[index]:
                    finish = "tool_calls"
            elif self.tools is not None and not finish and not role:
                text = None  # the arguments come as tool calls with the last chunk
            elif calls is not None:
                delta["tool_calls"] = [{"index": j, **call} for j, call in enumerate(calls)]
                text, finish = None, self.tools.finish_reason
            elif self.tools is not None and finish:
                text = self.text[index]  # not complete JSON: the output as text
            if text:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}
        if not role:
            choice["logprobs"] = self._logprobs_field(lp)
        if first and self.shows_prompt_logprobs:
            choice["prompt_logprobs"] = self._prompt_logprobs(index)
        if self.token_ids is not None and ids is not None:
            choice["token_ids"] = ids
        chunk = self._object([choice], chunk=True)
        if finish and any(s["index"] == index for s in self.spec):  # this choice's accept lengths
            chunk["speculative"] = [s for s in self.spec if s["index"] == index]
        return _event(chunk)

    def _chunks(self, ready: list[tuple[int, dict[str, Any], str, Any]]) -> list[str]:
        out = []
        for index, update, text, lp in ready:
            first = not self.shown_once[index]
            self.shown_once[index] = True
            if text or update["token_ids"] or update["finished"] or first:
                finish = self.finish[index] if update["finished"] else None
                ids = [] if self.echo_only else update["token_ids"]
                out.append(self._chunk(index, text, finish, ids=ids, lp=lp, first=first))
        return out

    async def stream(
        self, first: tuple[int, dict[str, Any]], events: AsyncIterator[tuple[int, dict[str, Any]]]
    ) -> AsyncIterator[str]:
        if self.chat:
            for i in range(len(self.text)):
                yield self._chunk(i, None, None, role=True)
        try:
            async for prompt, update in _chain(first, events):
                for chunk in self._chunks(self.feed(prompt, update)):
                    yield chunk
            for chunk in self._chunks(self.drain()):
                yield chunk
        except RequestFailed as failed:  # the stream has started: an error event says why it ended
            status = STATUS.get(failed.code, STATUS[ErrorCode.INTERNAL.value])[1]
            error = {"message": failed.message, "type": ERROR_TYPES.get(status, "api_error"), "code": failed.code}
            yield _event({"error": error})
            yield "data: [DONE]\n\n"
            return
        finally:
            await events.aclose()  # a client that left cancels the requests still running
        if self.include_usage:
            last = {**self._object([], chunk=True), "usage": self._usage()}
            if self.spec:
                last["speculative"] = self.spec
            yield _event(last)
        yield "data: [DONE]\n\n"


async def _chain(first: tuple[int, dict[str, Any]], rest: AsyncIterator) -> AsyncIterator[tuple[int, dict[str, Any]]]:
    yield first
    async for item in rest:
        yield item


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"
