"""Tool calls a model makes on its own (`tool_choice: "auto"`), parsed out of its text as vLLM's
tool parsers do. A format is data: the markers around a call and how a call's text reads. The
server uses the format its `tool_call_parser` setting names, or the one its chat template shows
(`detect`); text outside calls is the message's content, and a call that does not read as a call
of one of the request's tools stays text. Streamed, a call is sent once it is complete.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Callable, Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class ToolFormat:
    """How a model writes tool calls. `read` gives the (name, arguments) pairs of a call's text
    and raises ValueError for text that is not one."""

    name: str
    start: str  # opens a call
    end: str | None  # closes it; None: the call runs to the end of the output
    template_mark: str  # a chat template holding this text asks for the format
    read: Callable[[str], list[tuple[str, Any]]]
    first_only: bool = False  # a call only at the start of the output (after whitespace)
    start_in_call: bool = False  # `start` is the call's own first character (llama3_json's "{")


def _call(value: Any, *argument_keys: str) -> tuple[str, Any]:
    if not isinstance(value, Mapping) or not isinstance(value.get("name"), str):
        raise ValueError("a call is an object with a name")
    arguments = next((value[k] for k in argument_keys if k in value), None)
    if not isinstance(arguments, Mapping):
        raise ValueError(f"a call's {argument_keys[0]} are an object")
    return value["name"], arguments


def _hermes(text: str) -> list[tuple[str, Any]]:
    """`{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>` (Hermes, Qwen)."""
    return [_call(json.loads(text), "arguments")]


def _llama3_json(text: str) -> list[tuple[str, Any]]:
    """`{"name": ..., "parameters": {...}}` objects separated by `;`, the whole output (Llama 3.1
    and 3.2; their `<|python_tag|>` is a special token, not in the text)."""
    decoder, calls, i = json.JSONDecoder(), [], 0
    while True:
        value, i = decoder.raw_decode(text, i)
        calls.append(_call(value, "parameters", "arguments"))
        rest = text[i:].lstrip()
        if not rest:
            return calls
        if not rest.startswith(";"):
            raise ValueError("calls are separated by ';'")
        i = len(text) - len(rest[1:].lstrip())


TOOL_FORMATS = {
    f.name: f
    for f in (
        ToolFormat("hermes", "<tool_call>", "</tool_call>", "<tool_call>", _hermes),
        ToolFormat("llama3_json", "{", None, "<|python_tag|>", _llama3_json, first_only=True, start_in_call=True),
    )
}


def tool_format(setting: str, chat_template: str | Mapping[str, str] | None) -> ToolFormat | None:
    """The format the `tool_call_parser` setting asks for: a format's name, `none`, or `detect`
    (the first format whose mark the chat template holds; None when it holds none)."""
    if setting != "detect":
        return TOOL_FORMATS.get(setting)
    templates = chat_template.values() if isinstance(chat_template, Mapping) else [chat_template or ""]
    return next((f for f in TOOL_FORMATS.values() if any(f.template_mark in t for t in templates)), None)


def function_call(name: str, arguments: Any) -> dict[str, Any]:
    """One entry of OpenAI's `tool_calls`."""
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }


@dataclasses.dataclass(frozen=True)
class AutoTools:
    """A request's `tool_choice: "auto"`: the format and the names of its tools."""

    format: ToolFormat
    names: frozenset[str]

    def parser(self) -> ToolCallParser:
        return ToolCallParser(self.format, self.names)

    def parse(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """(content, tool calls) of a whole output."""
        return self.parser().feed(text, final=True)


class ToolCallParser:
    """Splits one choice's text, as it streams, into content and complete tool calls. Whitespace
    next to a call is not content; an output without calls is its own content, unchanged."""

    def __init__(self, fmt: ToolFormat, names: frozenset[str]) -> None:
        self.format, self.names = fmt, names
        self.buffer = ""  # text not split yet
        self.opened: str | None = None  # inside a call: its start marker's text (the buffer is the call)
        self.held = ""  # whitespace after content: dropped if a call follows
        self.began = False  # first_only: the output did not start with a call
        self.called = False
        self.after_call = False

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """(content to send now, calls completed now); `final`: the output ends with this delta."""
        self.buffer += delta
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        while True:
            if self.opened is not None:
                end = self.buffer.find(self.format.end) if self.format.end is not None else -1
                if end < 0 and not final:
                    break
                stop = end + len(self.format.end) if end >= 0 else len(self.buffer)
                read = self._read(self.buffer[: end if end >= 0 else len(self.buffer)])
                if read is None:  # not a call: its text is content
                    content.append(self._content(self.opened + self.buffer[:stop]))
                else:
                    calls += read
                    self.held, self.called, self.after_call = "", True, True
                self.buffer, self.opened = self.buffer[stop:], None
                continue
            at, hold = self._find(final)
            if at is None:
                content.append(self._content(self.buffer[: len(self.buffer) - hold]))
                self.buffer = self.buffer[len(self.buffer) - hold :]
                break
            content.append(self._content(self.buffer[:at]))
            skip = 0 if self.format.start_in_call else len(self.format.start)
            self.opened = self.buffer[at : at + skip]
            self.buffer = self.buffer[at + skip :]
        if final and not self.called:
            content.append(self.held)
        return "".join(content), calls

    def _find(self, final: bool) -> tuple[int | None, int]:
        """(where a call starts in the buffer, or None; how much of its end may still become a
        start marker and waits)."""
        start = self.format.start
        if self.format.first_only:
            if self.began:
                return None, 0
            rest = self.buffer.lstrip()
            if rest.startswith(start):
                return len(self.buffer) - len(rest), 0
            if not final and start.startswith(rest):
                return None, len(self.buffer)
            self.began = True
            return None, 0
        at = self.buffer.find(start)
        if at >= 0 or final:
            return (at if at >= 0 else None), 0
        partial = range(min(len(start) - 1, len(self.buffer)), 0, -1)
        return None, next((k for k in partial if start.startswith(self.buffer[-k:])), 0)

    def _read(self, text: str) -> list[dict[str, Any]] | None:
        try:
            pairs = self.format.read(text.strip())
        except ValueError:  # json's errors are ValueErrors too
            return None
        if any(name not in self.names for name, _ in pairs):
            return None
        return [function_call(name, arguments) for name, arguments in pairs]

    def _content(self, text: str) -> str:
        """Content to send; whitespace at its end waits, and after a call, at its start goes."""
        if self.after_call:
            text = text.lstrip()
            if not text:
                return ""
            self.after_call = False
        text = self.held + text
        shown = text.rstrip()
        self.held = text[len(shown) :]
        return shown
