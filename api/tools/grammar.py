"""The grammars tool calling constrains the output to, each written in the parser's own
format so that the same parser reads it back (vLLM constrains the same way):

- `tool_call_grammar`: tool_choice "required" or a named function: one call or more (one,
  without parallel tool calls) of the allowed functions;
- `text_or_calls_grammar`: tool_choice "auto" with strict tools: text without calls, or
  calls of the tools, the strict ones' arguments held to their `parameters`.

Lark grammars for llguidance, with each call's JSON as `%json` of a schema that names the
function and holds its `parameters`.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from runtime.protocol import close_objects

ANY_OBJECT: dict[str, Any] = {"type": "object"}
# one space after "," and ":", no other whitespace (llguidance's JSON options)
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
SEPARATOR = {"hermes": '"\\n"', "llama3_json": '"; "', "qwen3_xml": '"\\n"'}
# hermes' and qwen3_xml's calls open with <tool_call>. Text that holds no tag, and text up
# to and with the first tag: one lexeme each, so that the lexer never has to take back
# what it read as text
TEXT_WITHOUT_TAG = r"/(.|\n)*/ & ~/(.|\n)*<tool_call>(.|\n)*/"
TEXT_TO_TAG = r"/(.|\n)*<tool_call>/ & ~/(.|\n)*<tool_call>(.|\n)+/"
# llama3_json: text is content unless it starts (after whitespace) as a call would
TEXT_NOT_A_CALL = r"/(.|\n)*/ & ~/[ \t\r\n]*(\{|<\|python_tag\|>)(.|\n)*/"


def tool_call_grammar(parser: str, tools: list[dict[str, Any]], parallel: bool) -> str:
    """A Lark grammar: calls of `tools` (OpenAI function tools) in `parser`'s format."""
    more = f" ({SEPARATOR[parser]} call)*" if parallel else ""
    return f"start: call{more}\n{_call_rules(parser, tools)}\n"


def text_or_calls_grammar(parser: str, tools: list[dict[str, Any]], parallel: bool) -> str:
    """A Lark grammar: text with no call in it, or calls of `tools` (after some text, for
    the parsers whose calls open with a tag); a tool without `strict` takes any object."""
    held = [_held(parser, tool["function"]) for tool in tools]
    more = f" ({SEPARATOR[parser]} call)*" if parallel else ""
    rules = _call_rules(parser, [{"function": function} for function in held])
    if parser == "llama3_json":
        return f"start: TEXT | call{more}\nTEXT: {TEXT_NOT_A_CALL}\n{rules}\n"
    return (
        f"start: TEXT | LEAD call_body{more}\n"
        f"TEXT: {TEXT_WITHOUT_TAG}\nLEAD: {TEXT_TO_TAG}\n{rules}\n"
    )


def _held(parser: str, function: dict[str, Any]) -> dict[str, Any]:
    """The function as the grammar holds it: its parameters only if it is strict (the XML
    form always names them, and its values are text)."""
    if function.get("strict") or parser == "qwen3_xml":
        return function
    return function | {"parameters": ANY_OBJECT}


def _call_rules(parser: str, tools: list[dict[str, Any]]) -> str:
    functions = [tool["function"] for tool in tools]
    rules = {"hermes": _hermes_call, "llama3_json": _llama3_call, "qwen3_xml": _qwen3_xml_call}
    return rules[parser](functions)


def _envelope(functions: list[dict[str, Any]], arguments_key: str) -> str:
    """The schema of one call object: one of the functions, by name, with its parameters
    (their objects closed to the properties they name, unless they say otherwise: a
    function takes no arguments it does not declare), written compactly, as the formats'
    own examples are."""
    choices: list[dict[str, Any]] = [
        {
            "type": "object",
            "properties": {
                "name": {"const": function["name"]},
                arguments_key: _closed(function.get("parameters") or ANY_OBJECT),
            },
            "required": ["name", arguments_key],
            "additionalProperties": False,
        }
        for function in functions
    ]
    schema: dict[str, Any] = choices[0] if len(choices) == 1 else {"anyOf": choices}
    schema["x-guidance"] = COMPACT
    return json.dumps(schema, separators=(",", ":"))


def _closed(parameters: dict[str, Any]) -> dict[str, Any]:
    closed = copy.deepcopy(parameters)
    close_objects(closed)
    return closed


def _hermes_call(functions: list[dict[str, Any]]) -> str:
    return (
        'call: "<tool_call>" call_body\n'
        'call_body: "\\n" call_json "\\n</tool_call>"\n'
        f"call_json: %json {_envelope(functions, 'arguments')}"
    )


def _llama3_call(functions: list[dict[str, Any]]) -> str:
    return f"call: %json {_envelope(functions, 'parameters')}"


def _qwen3_xml_call(functions: list[dict[str, Any]]) -> str:
    """The XML form: the function's name and its parameters' names are fixed; each value is
    text up to the closing tag (its last newline too: a lexer's terminal takes all it can)."""
    rules = []
    names = []
    for i, function in enumerate(functions):
        properties = (function.get("parameters") or {}).get("properties") or {}
        parameters = " ".join(
            f'("<parameter=" {json.dumps(key)} ">\\n" VALUE "</parameter>\\n")?'
            for key in properties
        )
        head = json.dumps(f"<function={function['name']}>\n")
        rules.append(f'function{i}: {head} {parameters} "</function>"')
        names.append(f"function{i}")
    return "\n".join(
        [
            'call: "<tool_call>" call_body',
            f'call_body: "\\n" ({" | ".join(names)}) "\\n</tool_call>"',
            *rules,
            "VALUE: /[^<]+/",
        ]
    )
