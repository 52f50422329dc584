"""The field policy of every route, in one place: what a request may carry, and what becomes of
the rest.

- The fields a route implements are validated (the OpenAI routes' types strictly: `"0.5"` is
  not a temperature). Numbers that SGLang's own models coerce from strings (ports, ranks,
  counts: `LaxInt`) are coerced here too.
- `null` is the field's default, for every field.
- Fields that SGLang, vLLM or OpenAI define for a route and that cannot matter here are
  accepted whatever their value, as documented no-ops (`no_ops`: e.g. `user`, `load_format`).
- Fields whose meaning this engine cannot honour are accepted only at their default
  (`refused_unless`: e.g. `image_data`), and otherwise answered with a 400 naming them, so
  nothing a client asks for is silently dropped.
- Any other key is ignored, as vLLM ignores it: logged once per route and key, and named in
  the answer's `X-Ignored-Fields` header, so a client can see that a misspelled field did
  nothing. With `--strict-fields` such a key is a 400 instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from api.http.errors import UNSUPPORTED

# A count, a rank or a port: an int, or a numeric string as SGLang's pydantic models take it.
LaxInt = Annotated[int, Field(strict=False)]
LaxBool = Annotated[bool, Field(strict=False)]

MAX_REPORTED = 16  # ignored fields named in one answer's header
MAX_NAME = 64  # characters of a field's name in the header and the log


@dataclass(frozen=True, slots=True)
class Refusal:
    """A field accepted only at one of `accepted`, because `why`."""

    accepted: tuple[Any, ...]
    why: str


def refusals(*bases: Mapping[str, Refusal], **fields: Refusal) -> Mapping[str, Refusal]:
    """A `refused_unless` table: those of `bases`, then `fields`; read-only."""
    merged: dict[str, Refusal] = {}
    for base in bases:
        merged |= base
    return MappingProxyType(merged | fields)


class Body(BaseModel):
    """A request body (or a nested object of one) under the field policy."""

    model_config = ConfigDict(extra="allow", strict=True)
    no_ops: ClassVar[frozenset[str]] = frozenset()
    refused_unless: ClassVar[Mapping[str, Refusal]] = {}

    @model_validator(mode="before")
    @classmethod
    def _apply_policy(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        kept = {}
        for key, value in data.items():
            if value is None or key in cls.no_ops:
                continue  # the default
            refusal = cls.refused_unless.get(key)
            if refusal is None:
                kept[key] = value
            elif not any(_same(value, ok) for ok in refusal.accepted):
                # a pydantic error, so that it is named by its whole path (`a.b.key`)
                raise PydanticCustomError(UNSUPPORTED, "{why}", {"why": refusal.why, "field": key})
        return kept


def _same(value: Any, accepted: Any) -> bool:
    return type(value) is type(accepted) and value == accepted  # `1` is not `True`


def ignored_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """The keys of a validated body that no field took, by their path (`sampling_params.x`)."""
    found = [prefix + str(key) for key in model.model_extra or {}]
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            found += ignored_fields(value, f"{prefix}{name}.")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, BaseModel):
                    found += ignored_fields(item, f"{prefix}{name}[{i}].")
    return found


def header_value(names: list[str]) -> str:
    """The `X-Ignored-Fields` header: the first names, made safe for a header line."""
    shown = [_printable(name) for name in names[:MAX_REPORTED]]
    more = len(names) - len(shown)
    return ", ".join(shown + ([f"... ({more} more)"] if more > 0 else []))


def _printable(name: str) -> str:
    """A client's key as printable ASCII (a header may not carry a newline or a comma)."""
    safe = "".join(c if c.isascii() and c.isprintable() and c != "," else "?" for c in name)
    return safe if len(safe) <= MAX_NAME else safe[: MAX_NAME - 3] + "..."


class IgnoredLog:
    """Remembers which (route, field) pairs were logged, up to a bound: a client inventing new
    keys cannot grow it, or the log, without limit."""

    MAX_PAIRS = 1024

    def __init__(self) -> None:
        self._seen: set[tuple[str, str]] = set()

    def first_time(self, route: str, names: list[str]) -> list[str]:
        """Those of `names` not logged before for `route` (none once the bound is reached)."""
        new = []
        for name in names:
            pair = (route, _printable(name))
            if pair not in self._seen and len(self._seen) < self.MAX_PAIRS:
                self._seen.add(pair)
                new.append(pair[1])
        return new
