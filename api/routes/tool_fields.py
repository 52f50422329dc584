"""Tool calling's request fields, as OpenAI spells them: `tools`, `tool_choice` and the
history's `tool_calls` and `tool` messages. Each is checked here, so that a malformed tool,
a named tool that is not among the tools, or arguments that are not JSON are a 400 naming
the field before anything is rendered or queued."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from api.http.errors import APIError
from api.http.fields import Body
from runtime.protocol import check_depth

MAX_TOOLS = 128  # OpenAI's limit
MAX_CALLS = 128  # calls in one assistant message of the history
# OpenAI's rule for a function's name
FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]
CallId = Annotated[str, Field(min_length=1, max_length=256)]


class FunctionDefinition(Body):
    name: FunctionName
    description: Annotated[str, Field(max_length=64 * 1024)] | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: no parameters
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _not_too_deep(cls, parameters: dict[str, Any] | None) -> dict[str, Any] | None:
        check_depth(parameters)  # before anything walks it recursively
        return parameters


class Tool(Body):
    type: Literal["function"]
    function: FunctionDefinition

    def as_dict(self) -> dict[str, Any]:
        """The tool as the chat template and the grammar see it."""
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class ChosenFunction(Body):
    name: FunctionName


class NamedToolChoice(Body):
    type: Literal["function"]
    function: ChosenFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
Tools = Annotated[list[Tool], Field(max_length=MAX_TOOLS)]


class CalledFunction(Body):
    name: FunctionName
    arguments: str  # JSON text of an object, as the model wrote it

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, arguments: str) -> str:
        try:
            value = json.loads(arguments)
        except ValueError:
            raise ValueError("must be the JSON text of an object") from None
        if not isinstance(value, dict):
            raise ValueError("must be the JSON text of an object")
        return arguments


class ToolCall(Body):
    id: CallId
    type: Literal["function"] = "function"
    function: CalledFunction

    def as_dict(self) -> dict[str, Any]:
        """The call as templates read it: arguments as an object (Qwen's and the built-in
        template write it with `tojson`), as vLLM gives them."""
        function = {"name": self.function.name, "arguments": json.loads(self.function.arguments)}
        return {"id": self.id, "type": "function", "function": function}


ToolCalls = Annotated[list[ToolCall], Field(max_length=MAX_CALLS)]


def check_tools(tools: list[Tool], choice: ToolChoice | None) -> None:
    """The tools' names are distinct, and a tool_choice other than none or auto has tools,
    the named one among them."""
    names = [tool.function.name for tool in tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise invalid(f"tools[{i}].function.name", f"{name!r} names two tools")
    if choice in ("required", None, "none", "auto"):
        if choice == "required" and not tools:
            raise invalid("tool_choice", '"required" needs tools')
        return
    assert isinstance(choice, NamedToolChoice)
    if choice.function.name not in names:
        raise invalid(
            "tool_choice", f"names the function {choice.function.name!r}, which is not in tools"
        )


def check_call_ids(messages: list[Any]) -> None:
    """Each tool message answers a call an earlier assistant message made, by its id."""
    made: set[str] = set()
    for i, message in enumerate(messages):
        for call in message.tool_calls or ():
            made.add(call.id)
        if message.role == "tool" and message.tool_call_id not in made:
            raise invalid(
                f"messages[{i}].tool_call_id",
                "answers no call of an earlier assistant message's tool_calls",
            )


def invalid(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code="invalid_value")
