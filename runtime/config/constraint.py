"""A request's structured-output constraint: what its output must match.

Every API's spelling (OpenAI's `response_format`, vLLM's `structured_outputs` and `guided_*`,
SGLang's `json_schema`/`regex`/`ebnf`) maps to this one value. It is plain data, checked here
for what needs no grammar engine (the scheduler process reads it too and loads none): the
frontend compiles it once to refuse what llguidance cannot or should not build
(runtime/frontend/constraints.py), and the worker that samples builds its matchers from it
(runtime/worker/grammar_masks.py), both through runtime/structured.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# json: a JSON schema (its text); json_object: any JSON object (no source); regex; choice: a
# JSON list of strings; grammar: GBNF or Lark; structural_tag: vLLM's and SGLang's JSON object
# of tagged structures ({"structures": [{"begin", "schema", "end"}], "triggers": [...]})
KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
JSON_KINDS = ("json", "json_object")
# A schema, regex or grammar is compiled for every request that sends it: the cap bounds that
# work and what each NewSeq carries (llguidance itself has handled 4 MB schemas)
MAX_SOURCE_CHARS = 128 * 1024
MAX_WHITESPACE_PATTERN_CHARS = 256


def backend_name(name: str) -> str:
    """The structured-output backend a server flag names; only llguidance exists here."""
    if name in ("llguidance", "guidance", "auto"):  # vLLM calls it "guidance"
        return "llguidance"
    raise ValueError(
        f"structured-output backend {name!r} is not available: this server constrains "
        "decoding with llguidance only (backend 'llguidance', 'guidance' or 'auto')"
    )


@dataclass(frozen=True, slots=True)
class Constraint:
    """What the output must match. Invalid values raise ValueError at construction.

    Attributes:
        kind: one of KINDS.
        source: the schema, regex, choices (a JSON list), grammar or tags, as text.
        compact: JSON without whitespace between tokens (vLLM's disable_any_whitespace).
        whitespace_pattern: a regex for the whitespace JSON may have between tokens; None:
            the server's bounded default (runtime/structured.py).
        strict: objects take no properties but those they name, where the schema does not
            say (OpenAI's strict, vLLM's disable_additional_properties).
    """

    kind: str
    source: str = ""
    compact: bool = False
    whitespace_pattern: str | None = None
    strict: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(
                f"constraint kind must be one of {', '.join(KINDS)}, not {self.kind!r}"
            )
        if len(self.source) > MAX_SOURCE_CHARS:
            raise ValueError(
                f"the {self.kind} constraint is {len(self.source)} characters; at most "
                f"{MAX_SOURCE_CHARS} are accepted"
            )
        if self.kind != "json_object" and not self.source.strip():
            raise ValueError(f"the {self.kind} constraint is empty")
        pattern = self.whitespace_pattern
        if pattern is not None and not 0 < len(pattern) <= MAX_WHITESPACE_PATTERN_CHARS:
            raise ValueError(
                f"whitespace_pattern must be 1 to {MAX_WHITESPACE_PATTERN_CHARS} characters"
            )
        if pattern is not None and self.compact:
            raise ValueError("give a whitespace_pattern or disable_any_whitespace, not both")


def close_objects(schema: Any) -> None:
    """additionalProperties: false in every object schema that names properties and does not
    say (vLLM's rule for disable_additional_properties); depth already checked."""
    if isinstance(schema, list):
        for item in schema:
            close_objects(item)
    elif isinstance(schema, dict):
        for value in schema.values():
            close_objects(value)
        if "additionalProperties" not in schema and (
            "properties" in schema or "patternProperties" in schema
        ):
            schema["additionalProperties"] = False


MAX_SCHEMA_DEPTH = 64  # nested objects/arrays in a schema's JSON text


def check_depth(value: Any) -> None:
    """Refuse a schema nested deeper than MAX_SCHEMA_DEPTH (iteratively: no recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"nested deeper than {MAX_SCHEMA_DEPTH} levels")
        children = item.values() if isinstance(item, dict) else item
        if isinstance(item, dict | list):
            stack.extend((child, depth + 1) for child in children)
