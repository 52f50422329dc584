"""What a chat request's `tools` and `tool_choice` make of its answer, as vLLM documents it:

- `none` (or no tools): the text is the answer's content, whatever it holds;
- `auto`: the model chooses; the server's parser (--tool-call-parser) reads its calls, which
  are constrained only where a tool says `strict: true`; the server must be started with
  --enable-auto-tool-choice, or it is a 400 that names the flags;
- `required`: at least one call of the tools (one, without parallel tool calls), and a named
  function: one call of it; both are constrained decoding, in the parser's format (hermes if
  the server names none), so that the same parser reads the calls back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from api.http.errors import APIError
from api.tools.grammar import text_or_calls_grammar, tool_call_grammar
from api.tools.parsers import PARSERS, parameter_types
from api.tools.stream import ToolCallReader

CONSTRAINED_PARSER = "hermes"  # the format of forced calls where the server names no parser


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """How one request's answer is read, and what its output is constrained to.

    Attributes:
        reader: reads calls out of the text; None: the text is content.
        grammar: a Lark grammar the output is held to, or None.
    """

    reader: ToolCallReader | None = None
    grammar: str | None = None


def tool_choice(
    tools: list[dict[str, Any]],
    choice: str | dict[str, Any],
    parallel: bool,
    parser: str | None,
    auto_enabled: bool,
) -> ToolChoice:
    """`tools` as OpenAI's dicts; `choice` "none", "auto", "required" or a named function's
    {"type": "function", "function": {"name"}}; `parser` and `auto_enabled` the server's."""
    if not tools or choice == "none":
        return ToolChoice()
    if choice == "auto":
        if not (auto_enabled and parser):
            raise APIError(
                400,
                'tool_choice "auto" (the default with tools) needs the server started with '
                "--enable-auto-tool-choice --tool-call-parser NAME (hermes, llama3_json or "
                'qwen3_xml); or send tool_choice "required", "none" or a named function',
                param="tool_choice",
                code="invalid_value",
            )
        strict = any(tool["function"].get("strict") for tool in tools)
        grammar = text_or_calls_grammar(parser, tools, parallel) if strict else None
        return ToolChoice(_reader(parser, tools, parallel), grammar)
    parser = parser or CONSTRAINED_PARSER
    if choice != "required":
        assert isinstance(choice, dict)
        name = choice["function"]["name"]
        tools = [tool for tool in tools if tool["function"]["name"] == name]
        parallel = False
    grammar = tool_call_grammar(parser, tools, parallel)
    return ToolChoice(_reader(parser, tools, parallel), grammar)


def _reader(parser: str, tools: list[dict[str, Any]], parallel: bool) -> ToolCallReader:
    names = frozenset(tool["function"]["name"] for tool in tools)
    return ToolCallReader(PARSERS[parser], names, parameter_types(tools), single=not parallel)
