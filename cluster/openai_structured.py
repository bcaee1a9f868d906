"""OpenAI's and vLLM's ways of asking for structured output, as the generation API's one field
`structured_outputs` (`workers/grammar.py`): `response_format` (`json_object`, `json_schema`),
vLLM's `structured_outputs` and its older `guided_json`, `guided_regex`, `guided_choice` and
`guided_grammar`; and tool calls forced by `tool_choice` (`required` or a named function), which
are a JSON schema too. The OpenAI routes (`cluster/openai_api.py`) call `structured_outputs` on a
request's parameters and render the output as tool calls with `ToolCalls`. `tool_choice: "auto"`
constrains nothing: the model's own tool calls are parsed out of its text (`cluster/openai_tools.py`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from cluster.openai_tools import TOOL_FORMATS, AutoTools, ToolFormat, function_call
from cluster.protocol import clipped

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
FORMATS = ("text", "json_object", "json_schema")


class Refused(ValueError):
    """A parameter this door cannot take; `param` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclasses.dataclass(frozen=True)
class ToolCalls:
    """A chat answer carried as tool calls: the arguments of the function `name`, or (`name`
    None, `tool_choice: "required"`) a JSON list of `{"name", "parameters"}`."""

    name: str | None

    @property
    def finish_reason(self) -> str:
        """OpenAI's: "stop" when the request named the function, "tool_calls" otherwise."""
        return "stop" if self.name is not None else "tool_calls"

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """OpenAI's `tool_calls` of a finished output; None when it is not complete JSON."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        pairs = [(self.name, value)] if self.name is not None else [(c["name"], c["parameters"]) for c in value]
        return [function_call(n, a) for n, a in pairs]


@dataclasses.dataclass(frozen=True)
class Structured:
    """What a request asks for: the `structured_outputs` field (None: nothing), the parameter it
    came from (errors name it), tool calls forced, the tools the chat template is shown, and the
    tool calls to parse out of the text (`tool_choice: "auto"`)."""

    spec: dict[str, Any] | None = None
    source: str | None = None
    tools: ToolCalls | None = None
    template_tools: list[dict[str, Any]] | None = None
    auto: AutoTools | None = None


def structured_outputs(extra: Mapping[str, Any], chat: bool, tool_format: ToolFormat | None = None) -> Structured:
    """The request's structured outputs from its parameters (`extra`: those the request model
    does not declare), with `tool_format` the format of the model's own tool calls (None: it has
    none this server parses); Refused names the parameter."""
    given = {}
    if extra.get("response_format") is not None:
        spec = _response_format(extra["response_format"])
        if spec is not None:
            given["response_format"] = spec
    if extra.get("structured_outputs") is not None:
        value = extra["structured_outputs"]
        if not isinstance(value, Mapping):
            raise Refused("structured_outputs", f"must be an object, got {clipped(repr(value))}")
        given["structured_outputs"] = dict(value)
    for param, kind in GUIDED.items():
        if extra.get(param) is not None:
            given[param] = {kind: extra[param]}
    tools, template_tools, auto = _tools(extra, chat, tool_format)
    if tools is not None:
        given["tool_choice"] = tools[1]
    if len(given) > 1:
        names = " and ".join(given)
        raise Refused(next(iter(given)), f"{names} each constrain the output: give one of them")
    if not given:
        return Structured(template_tools=template_tools, auto=auto)
    source, spec = next(iter(given.items()))
    return Structured(spec, source, tools[0] if tools is not None else None, template_tools, auto)


def _response_format(value: Any) -> dict[str, Any] | None:
    if not isinstance(value, Mapping) or value.get("type") not in FORMATS:
        raise Refused("response_format", f"must be an object whose type is one of {list(FORMATS)}, got {_quote(value)}")
    if value["type"] == "text":
        return None
    if value["type"] == "json_object":
        return {"json_object": True}
    schema = value.get("json_schema")
    if not isinstance(schema, Mapping) or not isinstance(schema.get("schema", {}), (Mapping, bool)):
        raise Refused("response_format", f"json_schema: must be an object with a schema object, got {_quote(schema)}")
    if not isinstance(schema.get("strict", False), (bool, type(None))):
        raise Refused("response_format", f"json_schema.strict: must be true or false, got {_quote(schema['strict'])}")
    # strict or not, the output follows the schema (xgrammar's strict mode: no properties it does not name)
    return {"json": schema["schema"]} if "schema" in schema else {"json_object": True}


def _tools(
    extra: Mapping[str, Any], chat: bool, tool_format: ToolFormat | None
) -> tuple[tuple[ToolCalls, dict[str, Any]] | None, list | None, AutoTools | None]:
    """(tool calls forced by `tool_choice` with their schema, or None; the tools for the template;
    the tool calls to parse, or None)."""
    tools, choice = extra.get("tools"), extra.get("tool_choice")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise Refused("tool_choice", f"needs tools, got {_quote(choice)}")
        return None, None, None
    if not chat:
        raise Refused("tools", "tool calls are a chat completions parameter")
    if not isinstance(tools, list) or not all(_is_function(t) for t in tools):
        raise Refused("tools", 'must be a list of {"type": "function", "function": {"name": ..., "parameters": ...}}')
    functions = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    if len(functions) != len(tools):
        raise Refused("tools", "two tools have the same name")
    if choice in (None, "auto"):
        if tool_format is None:
            raise Refused(
                "tool_choice",
                "'auto' (the default with tools) lets the model write tool calls in its own format, and this "
                f"model's chat template shows none this server parses ({', '.join(TOOL_FORMATS)}; the tool_call_parser "
                'setting names one); use "none", "required" or {"type": "function", "function": {"name": ...}}',
            )
        return None, tools, AutoTools(tool_format, frozenset(functions))
    if choice == "none":
        return None, tools, None
    if choice == "required":
        items = [
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": parameters},
                "required": ["name", "parameters"],
            }
            for name, parameters in functions.items()
        ]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        return (ToolCalls(None), {"json": schema}), tools, None
    name = choice.get("function", {}).get("name") if isinstance(choice, Mapping) else None
    if name not in functions:
        raise Refused(
            "tool_choice",
            f'must be "auto", "none", "required" or {{"type": "function", "function": {{"name": ...}}}} naming one of '
            f"the tools {clipped(repr(sorted(functions)))}, got {_quote(choice)}",
        )
    return (ToolCalls(name), {"json": functions[name]}), tools, None


def _is_function(tool: Any) -> bool:
    function = tool.get("function") if isinstance(tool, Mapping) and tool.get("type") == "function" else None
    return (
        isinstance(function, Mapping)
        and isinstance(function.get("name"), str)
        and bool(function["name"])
        and isinstance(function.get("parameters") or {}, Mapping)
    )


def _quote(value: Any) -> str:
    return clipped(repr(value))
