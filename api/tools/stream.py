"""A model's text to OpenAI's `tool_calls`: whole (`read_calls`) or as stream deltas
(`ToolCallStream`), by one parser, so that the streamed deltas add up to the whole answer.

Deltas are shaped as the openai client accumulates them (it concatenates string fields and
keys calls by `index`): per call one delta with `index`, `id`, `type`, `function.name` and
`arguments: ""`, sent once the name is whole; then deltas with `index` and an `arguments`
fragment, the model's own text, never re-serialized.

A call to a function that is not among the request's tools, or text that began as a call and
cannot be one, is no call: the whole text is the answer's content. A stream finds that out
as the text comes; if it had already sent a call, it stops sending calls and ends as the
model did ("stop"), with what it sent so far.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from typing import Any

from api.tools.calls import CallText, Parsed
from api.tools.parsers import ParameterTypes, Parser


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True, slots=True)
class ToolCallReader:
    """A parser with what it needs from the request: the tools' names and parameter types."""

    parser: Parser
    names: Collection[str]
    types: ParameterTypes = field(default_factory=dict)
    single: bool = False  # without parallel tool calls: the first call alone is read

    def read(self, text: str, final: bool) -> Parsed | None:
        """The text so far; None if it holds no calls after all (all of it is content).
        A finished text whose calls never got as far as a name holds none."""
        parsed = self.parser(text, final, self.types)
        if self.single and len(parsed.calls) > 1:
            parsed = replace(parsed, calls=parsed.calls[:1])  # what follows is dropped
        names = [c.name for c in parsed.calls if c.name is not None]
        if parsed.broken or any(name not in self.names for name in names):
            return None
        if final and not names:
            return None
        return parsed


@dataclass(frozen=True, slots=True)
class ToolAnswer:
    """The whole answer: `content` (None if empty) and `tool_calls` in OpenAI's shape."""

    content: str | None
    tool_calls: list[dict[str, Any]]


def read_calls(reader: ToolCallReader, text: str) -> ToolAnswer:
    """The finished text's calls. A call the model did not finish (max_tokens) is given as
    far as it was written, as a stream would have sent it."""
    parsed = reader.read(text, final=True)
    if parsed is None or not parsed.calls:
        return ToolAnswer(text or None, [])
    calls = [_whole_call(call) for call in parsed.calls if call.name is not None]
    return ToolAnswer(parsed.content or None, calls)


def _whole_call(call: CallText) -> dict[str, Any]:
    function = {"name": call.name, "arguments": call.arguments}
    return {"id": call_id(), "type": "function", "function": function}


@dataclass(slots=True)
class _Sent:
    arguments: int = 0  # characters of the arguments sent


class ToolCallStream:
    """The deltas a stream sends as the text grows."""

    def __init__(self, reader: ToolCallReader) -> None:
        self.reader = reader
        self._content = 0  # characters of content sent
        self._calls: list[_Sent] = []
        self._plain = False  # the text turned out to hold no calls: it is content
        self._stopped = False  # ... after calls were sent: nothing more is sent

    @property
    def called(self) -> bool:
        """Whether calls were sent and stand (the finish reason is then "tool_calls")."""
        return bool(self._calls) and not self._stopped

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """The new content and call deltas, given all the text so far."""
        if self._stopped:
            return "", []
        parsed = None if self._plain else self.reader.read(text, final)
        if parsed is None:
            return self._as_content(text), []
        content = parsed.content[self._content :]
        self._content = len(parsed.content)
        return content, self._call_deltas(parsed.calls)

    def _as_content(self, text: str) -> str:
        """No calls after all: the rest of the text is content (or, once calls were sent,
        nothing more is)."""
        if self._calls:
            self._stopped = True
            return ""
        self._plain = True
        new = text[self._content :]
        self._content = len(text)
        return new

    def _call_deltas(self, calls: tuple[CallText, ...]) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        for index, call in enumerate(calls):
            if call.name is None:
                break  # its header waits for the whole name, and later calls wait for it
            if index == len(self._calls):
                self._calls.append(_Sent())
                function = {"name": call.name, "arguments": ""}
                deltas.append({"index": index, "id": call_id(), "type": "function",
                               "function": function})  # fmt: skip
            sent = self._calls[index]
            fragment = call.arguments[sent.arguments :]
            if fragment:
                sent.arguments = len(call.arguments)
                deltas.append({"index": index, "function": {"arguments": fragment}})
        return deltas
