"""Where a JSON value written by a model ends, read as it is written.

Tool-call parsers need the raw text of a call's arguments as the model writes them (streamed
fragments must concatenate to exactly the non-streamed string), so they cannot parse and
re-serialize: they find the value's extent in the text and cut it out. `value_end` reads one
value from a position and says where it ends, that it has not ended yet (the text so far is a
prefix of one), or that it cannot be JSON.
"""

from __future__ import annotations

from dataclasses import dataclass

WHITESPACE = " \t\n\r"
_LITERALS = ("true", "false", "null")
_NUMBER_CHARS = frozenset("0123456789+-.eE")


@dataclass(frozen=True, slots=True)
class Scan:
    """`end`: where the value ends (exclusive), None if the text ends first; `broken`: the text
    cannot be the beginning of a JSON value."""

    end: int | None = None
    broken: bool = False


OPEN = Scan()
BROKEN = Scan(broken=True)


def skip_whitespace(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def value_end(text: str, start: int) -> Scan:
    """The JSON value that begins at `start` (no whitespace before it)."""
    if start >= len(text):
        return OPEN
    first = text[start]
    if first == '"':
        return string_end(text, start)
    if first in "{[":
        return _container_end(text, start)
    if first in "-0123456789":
        return _number_end(text, start)
    for literal in _LITERALS:
        written = text[start : start + len(literal)]
        if literal.startswith(written):
            return Scan(start + len(literal)) if written == literal else OPEN
    return BROKEN


def string_end(text: str, start: int) -> Scan:
    """The JSON string that begins with the quote at `start`."""
    i = start + 1
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2
            continue
        if char == '"':
            return Scan(i + 1)
        if char < " ":  # a raw control character: JSON strings escape them
            return BROKEN
        i += 1
    return OPEN


def _number_end(text: str, start: int) -> Scan:
    i = start
    while i < len(text) and text[i] in _NUMBER_CHARS:
        i += 1
    return OPEN if i == len(text) else Scan(i)  # more digits may come


def _container_end(text: str, start: int) -> Scan:
    """An object or array: its members in turn, each checked as it is written."""
    closing = "}" if text[start] == "{" else "]"
    is_object = closing == "}"
    i = skip_whitespace(text, start + 1)
    if i < len(text) and text[i] == closing:
        return Scan(i + 1)
    while True:
        if is_object:
            i, scan = _key(text, i)
            if scan is not None:
                return scan
        member = value_end(text, i)
        if member.end is None:
            return member
        i = skip_whitespace(text, member.end)
        if i >= len(text):
            return OPEN
        if text[i] == closing:
            return Scan(i + 1)
        if text[i] != ",":
            return BROKEN
        i = skip_whitespace(text, i + 1)


def _key(text: str, i: int) -> tuple[int, Scan | None]:
    """Past an object member's key and its colon: (where the value begins, None), or the scan
    to return (open, or broken)."""
    if i >= len(text):
        return i, OPEN
    if text[i] != '"':
        return i, BROKEN
    key = string_end(text, i)
    if key.end is None:
        return i, key
    i = skip_whitespace(text, key.end)
    if i >= len(text):
        return i, OPEN
    if text[i] != ":":
        return i, BROKEN
    return skip_whitespace(text, i + 1), None
