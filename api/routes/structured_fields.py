"""Structured output as OpenAI's, vLLM's and SGLang's APIs spell it, all mapped to one
`Constraint`: a request may constrain its output one way (more is a 400 naming them).

- OpenAI (chat and completions): `response_format` of type `json_object`, `json_schema`
  (`{"name", "description", "schema", "strict"}`), or vLLM's `structural_tag`.
- vLLM: `structured_outputs: {json | regex | choice | grammar | json_object | structural_tag,
  disable_any_whitespace, disable_additional_properties, whitespace_pattern}`, and the older
  top-level `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`,
  `guided_whitespace_pattern` (`guided_decoding_backend` is accepted and does nothing: the
  server's flag names the backend).
- SGLang: `json_schema` (a JSON string), `regex`, `ebnf`, `structural_tag`, in /generate's
  `sampling_params` and on its OpenAI routes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from typing import Annotated, Any, Literal

from pydantic import Field

from api.http.errors import APIError
from api.http.fields import Body
from runtime.protocol import Constraint

MAX_CONSTRAINT_CHARS = 128 * 1024  # as the engine's cap (runtime/config/constraint.py)
MAX_CHOICES = 1024

Source = Annotated[str, Field(min_length=1, max_length=MAX_CONSTRAINT_CHARS)]
Schema = dict[str, Any] | Source  # a JSON schema, or its text
Choice = Annotated[str, Field(min_length=1)]
Choices = Annotated[list[Choice], Field(min_length=1, max_length=MAX_CHOICES)]
WhitespacePattern = Annotated[str, Field(min_length=1, max_length=256)]
# (field name, the constraint it asks for, built only if it is the request's one)
Spelling = tuple[str, Callable[[], Constraint]]


def _text(schema: Schema | list[Any]) -> str:
    return schema if isinstance(schema, str) else json.dumps(schema)


class JsonSchemaFormat(Body):
    """OpenAI's `response_format.json_schema`."""

    no_ops = frozenset({"name", "description"})  # labels for the model's provider
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # none: any object
    strict: bool | None = None

    def constraint(self) -> Constraint:
        if self.schema_ is None:
            return Constraint("json_object", strict=bool(self.strict))
        return Constraint("json", _text(self.schema_), strict=bool(self.strict))


class ResponseFormat(Body):
    """OpenAI's `response_format` (vLLM's `structural_tag` type too)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    structures: list[dict[str, Any]] | None = None  # of a structural_tag
    triggers: list[str] | None = None

    def constraint(self) -> Constraint:
        """The constraint of a type other than text."""
        if self.type == "json_schema":
            if self.json_schema is None:
                raise _invalid("response_format.json_schema", "is required with json_schema")
            return self.json_schema.constraint()
        if self.type == "structural_tag":
            tag = {"structures": self.structures or [], "triggers": self.triggers or []}
            return Constraint("structural_tag", json.dumps(tag))
        return Constraint("json_object")


class StructuredOutputs(Body):
    """vLLM's `structured_outputs` object."""

    no_ops = frozenset({"disable_fallback", "backend", "_backend", "_backend_was_auto"})
    json_: Schema | None = Field(default=None, alias="json")
    regex: Source | None = None
    choice: Choices | None = None
    grammar: Source | None = None
    json_object: bool | None = None
    structural_tag: Source | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: WhitespacePattern | None = None

    def constraint(self) -> Constraint | None:
        options = (
            self.disable_any_whitespace,
            self.whitespace_pattern,
            self.disable_additional_properties,
        )
        found = _given(self, (("regex", "regex"), ("grammar", "grammar"), ("choice", "choice"),
                              ("structural_tag", "structural_tag")))  # fmt: skip
        if self.json_ is not None:
            found.append(("json", partial(Constraint, "json", _text(self.json_), *options)))
        if self.json_object:
            found.append(("json_object", partial(Constraint, "json_object", "", *options)))
        return one_constraint(found, "structured_outputs.")


class StructuredFields(Body):
    """The structured-output fields every generation route takes (the OpenAI routes add
    `response_format`); `constraint()` is the one they ask for."""

    guided_json: Schema | None = None
    guided_regex: Source | None = None
    guided_choice: Choices | None = None
    guided_grammar: Source | None = None
    guided_whitespace_pattern: WhitespacePattern | None = None
    guided_decoding_backend: str | None = None  # accepted, and the server's flag decides
    structured_outputs: StructuredOutputs | None = None
    json_schema: Schema | None = None  # SGLang's: the schema's text
    regex: Source | None = None
    ebnf: Source | None = None
    structural_tag: Schema | None = None

    def constraint(self) -> Constraint | None:
        """The request's constraint (None: free text); a 400 if it asks for more than one, or
        for one that is malformed on its face (compiling it tells the rest)."""
        return one_constraint(self.spellings())

    def spellings(self) -> list[Spelling]:
        """Every constraint the request spells (routes with more fields extend this)."""
        found = _given(self, _TOP_LEVEL)
        if self.guided_json is not None:
            pattern = self.guided_whitespace_pattern
            schema = partial(Constraint, "json", _text(self.guided_json), False, pattern)
            found.append(("guided_json", schema))
        outputs = self.structured_outputs
        inner = outputs.constraint() if outputs is not None else None
        if inner is not None:
            found.append(("structured_outputs", partial(_same, inner)))
        return found


# top-level fields that are a constraint of one kind, with no options
_TOP_LEVEL = (
    ("guided_regex", "regex"),
    ("guided_choice", "choice"),
    ("guided_grammar", "grammar"),
    ("json_schema", "json"),
    ("regex", "regex"),
    ("ebnf", "grammar"),
    ("structural_tag", "structural_tag"),
)


def _given(body: Body, fields: tuple[tuple[str, str], ...]) -> list[Spelling]:
    """The spellings of those `fields` (name, kind) that `body` has."""
    return [
        (name, partial(Constraint, kind, _text(getattr(body, name))))
        for name, kind in fields
        if getattr(body, name) is not None
    ]


def _same(constraint: Constraint) -> Constraint:
    return constraint


def one_constraint(found: list[Spelling], prefix: str = "") -> Constraint | None:
    """The one constraint of `found`, built; a 400 for two, or for a malformed one."""
    if len(found) > 1:
        names = " and ".join(prefix + name for name, _ in found[:2])
        raise _invalid(
            prefix + found[1][0], f"constrains the output too: give one of {names}, not both"
        )
    if not found:
        return None
    name, build = found[0]
    try:
        return build()
    except ValueError as exc:
        raise _invalid(prefix + name, str(exc)) from None


def _invalid(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code="invalid_value")
