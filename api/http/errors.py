"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError

from runtime.protocol import EngineDeadError, RequestTimeoutError

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    503: "service_unavailable_error",
}


UNSUPPORTED = "unsupported_parameter"  # the error code of a field we cannot honour


class APIError(Exception):
    """An error answered to the client with its HTTP status; the server carries on."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "internal_error"),
                "param": self.param,
                "code": self.code,
            }
        }


# Fields that accept several shapes: one message instead of one per rejected alternative.
_SHAPES = {
    "prompt": "must be a string, a list of token ids, or a list of strings or token-id lists",
    "stop": "must be a string or a list of strings",
    "content": "must be a string or a list of text parts",
}


def from_validation_error(exc: ValidationError) -> APIError:
    """The most telling problem pydantic found, named by its path (`messages[0].content[1].type`).

    Of a field that takes several shapes, the shape that went deepest into the input is the one
    the client meant (a list of parts, say, rather than a string); text that is not Unicode (a
    lone surrogate, which JSON can carry) is reported as that, whatever the shapes.
    """
    errors = exc.errors(include_url=False)
    refused = [e for e in errors if e["type"] == UNSUPPORTED]  # a field policy's refusal
    if refused:
        context = refused[0].get("ctx") or {}
        path = _render([*_path(refused[0]["loc"]), context.get("field", "")])
        return unsupported(path, context.get("why", "is not supported"))
    unicode = [e for e in errors if e["type"] == "string_unicode"]
    first = unicode[0] if unicode else max(errors, key=_telling)
    parts = _path(first["loc"])
    param = _render(parts) or None
    if first["type"] == "extra_forbidden":
        return APIError(400, f"unknown field {param!r}", param=param, code="unknown_parameter")
    if first["type"] == "string_unicode":
        message = f"{param}: is not valid Unicode text (a lone surrogate?)"
    elif _wrong_type(first) and (shaped := _shape_field(parts)):  # no shape of it fits
        param = _render(shaped)
        message = f"{param}: {_SHAPES[str(shaped[-1])]}"
    elif first["type"] == "literal_error":  # e.g. a content part of a type we do not take
        given = repr(first["input"])
        given = given if len(given) <= 80 else given[:77] + "..."
        message = f"{param}: {given} is not supported: {first['msg']}"
    else:
        message = f"{param}: {first['msg']}" if param else str(first["msg"])
    return APIError(400, message, param=param, code="invalid_value")


def _telling(error: Any) -> tuple[bool, int]:
    """A wrong value is more telling than a wrong type (the input may be of another shape the
    field takes), and a deeper problem than a shallower one."""
    return not _wrong_type(error), len(_path(error["loc"]))


def _wrong_type(error: Any) -> bool:
    return str(error["type"]).endswith(("_type", "_parsing"))


def _shape_field(parts: list[int | str]) -> list[int | str]:
    """The path up to the last field that takes several shapes, if any."""
    for i in range(len(parts), 0, -1):
        if parts[i - 1] in _SHAPES:
            return parts[:i]
    return []


def _path(loc: tuple[int | str, ...]) -> list[int | str]:
    """The fields and indexes of a location, without the names of union alternatives
    (`str`, `list[TextPart]`, `constrained-str`...): field names are snake_case words."""
    return [
        part
        for part in loc
        if isinstance(part, int) or (_FIELD.fullmatch(part) and part not in _TYPE_NAMES)
    ]


def _render(parts: list[int | str]) -> str:
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else f".{part}" if text else part
    return text


_FIELD = re.compile(r"[a-z_][a-z0-9_]*")
_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def engine_stopped(error: EngineDeadError) -> APIError:
    return APIError(503, f"the engine stopped: {error}", code="engine_dead")


def timed_out(error: RequestTimeoutError) -> APIError:
    return APIError(408, str(error), code="request_timeout")


def unsupported(param: str, why: str) -> APIError:
    return APIError(400, f"{param}: {why}", param=param, code=UNSUPPORTED)
