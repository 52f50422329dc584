"""One call written as a JSON object, `{"name": ..., "arguments": {...}}`, read as it is
written: the name once whole, the arguments' raw text as far as written, where it ends."""

from __future__ import annotations

import json
from dataclasses import dataclass

from api.tools.json_scan import skip_whitespace, string_end, value_end


@dataclass(frozen=True, slots=True)
class CallObject:
    """`end`: where the object ends (None while open); `broken`: it cannot be a call."""

    name: str | None = None
    arguments: str = ""
    end: int | None = None
    broken: bool = False


def read_call_object(text: str, start: int, argument_keys: tuple[str, ...]) -> CallObject:
    """The call object that begins at `start` (at its `{`). Its arguments are the raw text of
    the first of `argument_keys` it holds ("{}" if a whole object holds none)."""
    if start >= len(text):
        return CallObject()
    if text[start] != "{":
        return CallObject(broken=True)
    name: str | None = None
    arguments: str | None = None
    i = skip_whitespace(text, start + 1)
    while True:
        if i >= len(text):
            return CallObject(name, arguments or "")
        if text[i] == "}" and name is None and arguments is None:
            return CallObject(broken=True)  # {} names nothing
        if text[i] != '"':
            return CallObject(broken=True)
        key_scan = string_end(text, i)
        if key_scan.end is None:
            return CallObject(name, arguments or "", broken=key_scan.broken)
        key = json.loads(text[i : key_scan.end])
        i = skip_whitespace(text, key_scan.end)
        if i >= len(text):
            return CallObject(name, arguments or "")
        if text[i] != ":":
            return CallObject(broken=True)
        i = skip_whitespace(text, i + 1)
        scan = value_end(text, i)
        if scan.broken:
            return CallObject(broken=True)
        if key in argument_keys and arguments is None:
            arguments = text[i : scan.end if scan.end is not None else len(text)]
        if scan.end is None:
            return CallObject(name, arguments or "")
        if key == "name":
            name = json.loads(text[i : scan.end])
            if not isinstance(name, str) or not name:
                return CallObject(broken=True)
        i = skip_whitespace(text, scan.end)
        if i >= len(text):
            return CallObject(name, arguments or "")
        if text[i] == "}":
            return _whole(name, arguments, i + 1)
        if text[i] != ",":
            return CallObject(broken=True)
        i = skip_whitespace(text, i + 1)


def _whole(name: str | None, arguments: str | None, end: int) -> CallObject:
    """A closed object: a call if it names a function and its arguments are an object."""
    if name is None:
        return CallObject(broken=True)
    arguments = "{}" if arguments is None else arguments
    try:
        if not isinstance(json.loads(arguments), dict):
            return CallObject(broken=True)
    except ValueError:  # a number's characters that are no number ("1-2")
        return CallObject(broken=True)
    return CallObject(name, arguments, end)
