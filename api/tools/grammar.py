"""The grammar `tool_choice` "required" or a named function constrains the output to: one
call or more (one, without parallel tool calls) of the allowed functions, each written in
the parser's own format, so that the same parser reads it back. A Lark grammar for
llguidance, with each call's JSON as `%json` of a schema that names the function and holds
its `parameters` (vLLM constrains the same way).
"""

from __future__ import annotations

import json
from typing import Any

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def tool_call_grammar(parser: str, tools: list[dict[str, Any]], parallel: bool) -> str:
    """A Lark grammar: calls of `tools` (OpenAI function tools) in `parser`'s format."""
    functions = [tool["function"] for tool in tools]
    call = {
        "hermes": _hermes_call,
        "llama3_json": _llama3_call,
        "qwen3_xml": _qwen3_xml_call,
    }[parser](functions)
    separator = {"hermes": '"\\n"', "llama3_json": '"; "', "qwen3_xml": '"\\n"'}[parser]
    start = f"start: call ({separator} call)*" if parallel else "start: call"
    return f"{start}\n{call}\n"


def _envelope(functions: list[dict[str, Any]], arguments_key: str) -> str:
    """The schema of one call object: one of the functions, by name, with its parameters."""
    choices = [
        {
            "type": "object",
            "properties": {
                "name": {"const": function["name"]},
                arguments_key: function.get("parameters") or ANY_OBJECT,
            },
            "required": ["name", arguments_key],
            "additionalProperties": False,
        }
        for function in functions
    ]
    schema = choices[0] if len(choices) == 1 else {"anyOf": choices}
    return json.dumps(schema, separators=(",", ":"))


def _hermes_call(functions: list[dict[str, Any]]) -> str:
    return (
        'call: "<tool_call>\\n" call_json "\\n</tool_call>"\n'
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
            f'call: "<tool_call>\\n" ({" | ".join(names)}) "\\n</tool_call>"',
            *rules,
            "VALUE: /[^<]+/",
        ]
    )
