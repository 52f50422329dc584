"""What a tool-call parser reads from a model's text so far."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class CallText:
    """One tool call as far as it is written.

    Attributes:
        name: the function's name, once all of it is written (None before).
        arguments: the arguments' JSON text as the model writes it, as much as is written
            (for a format that is not JSON, the JSON built from what is complete): a later
            reading of a longer text only adds to it.
        complete: the call is closed and its arguments are a whole JSON object.
    """

    name: str | None
    arguments: str
    complete: bool


@dataclass(frozen=True, slots=True)
class Parsed:
    """A model's text so far, read by a tool-call parser.

    Attributes:
        content: the text before the first call, as far as it surely is not the beginning
            of one (a later reading only adds to it).
        calls: the calls begun so far, in order.
        broken: something began as a call but cannot be one (not JSON, not the format): the
            whole text is content after all.
    """

    content: str
    calls: tuple[CallText, ...] = field(default=())
    broken: bool = False


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the beginning of `marker`: content
    that must wait for the next token to tell."""
    for keep in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-keep:]):
            return keep
    return 0
