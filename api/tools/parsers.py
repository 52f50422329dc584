"""Tool-call parsers: pure functions of a model's text so far to its content and calls
(`Parsed`), one per format a model family writes, chosen by `--tool-call-parser`.

A parser reads the whole text so far each time; streaming sends the difference between two
readings (api/tools/stream.py). Every field only grows from one reading to the next, so what
was sent stays true, and the streamed pieces add up to the final reading.

- `hermes` (Hermes, Qwen2.5, Qwen3, and our built-in template): one block per call,
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.
- `llama3_json` (Llama 3.1-3.3): the whole answer is calls, `{"name": ..., "parameters":
  {...}}`, after an optional `<|python_tag|>`, several separated by `;`.
- `qwen3_xml` (Qwen3-Coder): `<tool_call>\\n<function=NAME>\\n<parameter=P>\\nvalue\\n
  </parameter>\\n</function>\\n</tool_call>`; values become JSON by the tool's parameter types.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any

from api.tools.call_object import read_call_object
from api.tools.calls import CallText, Parsed, held_back
from api.tools.json_scan import skip_whitespace

# A tool's parameter types by name, from its JSON schema's `properties` (qwen3_xml reads them).
ParameterTypes = Mapping[str, Mapping[str, str]]
Parser = Callable[[str, bool, ParameterTypes], Parsed]

TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


def hermes(text: str, final: bool, types: ParameterTypes) -> Parsed:
    first = text.find(TOOL_CALL)
    if first < 0:
        return Parsed(text if final else text[: len(text) - held_back(text, TOOL_CALL)])
    calls: list[CallText] = []
    start = first
    while True:
        i = skip_whitespace(text, start + len(TOOL_CALL))
        call = read_call_object(text, i, ("arguments", "parameters"))
        if call.broken:
            return Parsed(text[:first], tuple(calls), broken=True)
        if call.end is None:
            calls.append(CallText(call.name, call.arguments, False))
            return Parsed(text[:first], tuple(calls))
        closed, after = _closing(text, call.end, TOOL_CALL_END)
        if closed is None:
            return Parsed(text[:first], tuple(calls), broken=True)
        calls.append(CallText(call.name, call.arguments, closed))
        if not closed:
            return Parsed(text[:first], tuple(calls))
        start = text.find(TOOL_CALL, after)
        if start < 0:
            return Parsed(text[:first], tuple(calls))


def llama3_json(text: str, final: bool, types: ParameterTypes) -> Parsed:
    i = skip_whitespace(text, 0)
    rest = text[i:]
    if rest.startswith(PYTHON_TAG):
        i = skip_whitespace(text, i + len(PYTHON_TAG))
    elif not rest.startswith("{"):
        if final or not PYTHON_TAG.startswith(rest):
            return Parsed(text)  # no call: all of it is content
        return Parsed("")  # the tag may be coming
    calls: list[CallText] = []
    while True:
        call = read_call_object(text, i, ("parameters", "arguments"))
        if call.broken:
            return Parsed("", tuple(calls), broken=True)
        calls.append(CallText(call.name, call.arguments, call.end is not None))
        if call.end is None:
            return Parsed("", tuple(calls))
        i = skip_whitespace(text, call.end)
        if i >= len(text):
            return Parsed("", tuple(calls))
        if text[i] != ";":
            return Parsed("", tuple(calls), broken=True)
        i = skip_whitespace(text, i + 1)
        if i >= len(text):
            return Parsed("", tuple(calls))


_FUNCTION = re.compile(r"<function=([^>\n]+)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>")


def qwen3_xml(text: str, final: bool, types: ParameterTypes) -> Parsed:
    first = text.find(TOOL_CALL)
    if first < 0:
        return Parsed(text if final else text[: len(text) - held_back(text, TOOL_CALL)])
    calls: list[CallText] = []
    start = first
    while start >= 0:
        end = text.find(TOOL_CALL_END, start)
        block = text[start + len(TOOL_CALL) : end if end >= 0 else len(text)]
        call = _xml_call(block, end >= 0, types)
        if call is None:
            return Parsed(text[:first], tuple(calls), broken=True)
        calls.append(call)
        if end < 0:
            break
        start = text.find(TOOL_CALL, end + len(TOOL_CALL_END))
    return Parsed(text[:first], tuple(calls))


def _xml_call(block: str, closed: bool, types: ParameterTypes) -> CallText | None:
    """One `<function=...>` block (None: it is not one). Its arguments grow a whole
    parameter at a time: a value's JSON form depends on all of it."""
    head = _FUNCTION.search(block)
    if head is None:  # the name is not whole yet, or this is no function block
        begun = block.lstrip()
        if closed or not (begun.startswith("<function=") or "<function=".startswith(begun)):
            return None
        return CallText(None, "", False)
    name = head.group(1).strip()
    body = block[head.end() :]
    function_closed = "</function>" in body
    body = body.split("</function>", 1)[0]
    pieces = []
    for match in _PARAMETER.finditer(body):
        value_end = body.find("</parameter>", match.end())
        if value_end < 0:
            break
        key = match.group(1).strip()
        raw = _strip_one_newline(body[match.end() : value_end])
        value = _typed(raw, types.get(name, {}).get(key))
        pieces.append(f"{json.dumps(key, ensure_ascii=False)}: {value}")
    arguments = "{" + ", ".join(pieces) + ("}" if function_closed else "")
    if closed and not function_closed:
        return None
    return CallText(name, arguments, closed)


def _strip_one_newline(raw: str) -> str:
    raw = raw[1:] if raw.startswith("\n") else raw
    return raw[:-1] if raw.endswith("\n") else raw


def _typed(raw: str, kind: str | None) -> str:
    """A parameter's value as JSON text, by its declared type (a string if it is not one)."""
    if kind == "string":
        return json.dumps(raw, ensure_ascii=False)
    try:
        value: Any = json.loads(raw)
    except ValueError:
        return json.dumps(raw, ensure_ascii=False)
    fits = {
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "object": lambda v: isinstance(v, dict),
        "array": lambda v: isinstance(v, list),
        "null": lambda v: v is None,
    }
    if kind in fits and not fits[kind](value):
        return json.dumps(raw, ensure_ascii=False)
    return json.dumps(value, ensure_ascii=False)


def _closing(text: str, i: int, tag: str) -> tuple[bool | None, int]:
    """After a call object: its closing tag (True), the text ending before it (False), or
    something else (None); and where the text after the tag begins."""
    i = skip_whitespace(text, i)
    rest = text[i : i + len(tag)]
    if rest == tag:
        return True, i + len(tag)
    if tag.startswith(rest):
        return False, i
    return None, i


PARSERS: dict[str, Parser] = {"hermes": hermes, "llama3_json": llama3_json, "qwen3_xml": qwen3_xml}


def parameter_types(tools: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """Each tool's parameters' declared JSON types (the first, for a list of them)."""
    types: dict[str, dict[str, str]] = {}
    for tool in tools:
        function = tool.get("function", {})
        properties = (function.get("parameters") or {}).get("properties") or {}
        kinds = {}
        for key, schema in properties.items():
            kind = schema.get("type") if isinstance(schema, dict) else None
            kind = kind[0] if isinstance(kind, list) and kind else kind
            if isinstance(kind, str):
                kinds[key] = kind
        types[function.get("name", "")] = kinds
    return types
