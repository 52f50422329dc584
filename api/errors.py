"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from runtime.engine_client import EngineDeadError, RequestTimeoutError

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    503: "service_unavailable_error",
}


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
    """The first problem pydantic found, named by its field path (e.g. `messages.0.role`)."""
    errors = exc.errors(include_url=False)
    # text that is not Unicode (a lone surrogate, which JSON can carry) says so, whatever
    # other shapes the field would also have accepted
    first = next((e for e in errors if e["type"] == "string_unicode"), errors[0])
    path: list[str] = []
    for part in first["loc"]:
        if not (isinstance(part, int) or str(part).isidentifier()):
            break  # the name of a union alternative, not a field
        path.append(str(part))
    param = ".".join(path) or None
    if first["type"] == "extra_forbidden":
        return APIError(400, f"unknown field {param!r}", param=param, code="unknown_parameter")
    if first["type"] == "string_unicode":
        message = f"{param}: is not valid Unicode text (a lone surrogate?)"
    elif len(path) < len(first["loc"]) and path and path[-1] in _SHAPES:
        message = f"{param}: {_SHAPES[path[-1]]}"
    else:
        message = f"{param}: {first['msg']}" if param else str(first["msg"])
    return APIError(400, message, param=param, code="invalid_value")


def engine_stopped(error: EngineDeadError) -> APIError:
    return APIError(503, f"the engine stopped: {error}", code="engine_dead")


def timed_out(error: RequestTimeoutError) -> APIError:
    return APIError(408, str(error), code="request_timeout")


def unsupported(param: str, why: str) -> APIError:
    return APIError(400, f"{param}: {why}", param=param, code="unsupported_parameter")
