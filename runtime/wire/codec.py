"""The one msgpack codec for every message the actors exchange.

A message is a frozen, slotted dataclass registered under a small integer tag. On the wire it is
the msgpack array `[tag, field0, field1, ...]`; nested messages nest the same way. Decoding checks
every field against the class's type hints, so a peer speaking another version, or garbage, gets a
`WireError` naming the message, the field and what was wrong, never a half-built object.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, TypeVar, dataclass_transform

import msgpack

T = TypeVar("T")
Check = Callable[[Any, str], Any]


class WireError(ValueError):
    """A message could not be decoded: unknown tag, wrong arity or a field of the wrong type."""


_TAG_OF: dict[type, int] = {}
_CLASS_OF: dict[int, type] = {}
_DECODERS: dict[int, Callable[[list[Any], str], Any]] = {}  # built on first use of each tag


def register(tag: int) -> Callable[[type[T]], type[T]]:
    """Class decorator: give a frozen dataclass a wire tag (its decoder is built on first use)."""

    def wrap(cls: type[T]) -> type[T]:
        if tag in _CLASS_OF:
            raise ValueError(f"wire tag {tag} used twice")
        _TAG_OF[cls] = tag
        _CLASS_OF[tag] = cls
        return cls

    return wrap


@dataclass_transform(frozen_default=True)
def message(tag: int) -> Callable[[type[T]], type[T]]:
    """Declare a message: `@message(7) class Foo: ...` is a frozen slotted dataclass with tag 7."""

    def wrap(cls: type[T]) -> type[T]:
        return register(tag)(dataclass(frozen=True, slots=True)(cls))

    return wrap


# Tuples here are built from lists, never from generators: CPython 3.11 sizes a tuple made
# from a generator by growing it, so each one lands on another length's free list, and those
# fill up to 2,000 tuples per length. Measured: ~5 MB of scheduler RSS that grew for tens of
# thousands of requests (benchmarks/soak.py), looking like a leak.
_NAMES_OF: dict[type, tuple[str, ...]] = {}  # each message's field names, computed once


def _pack_default(obj: object) -> list[Any]:
    cls = type(obj)
    tag = _TAG_OF.get(cls)
    if tag is None:
        raise TypeError(f"cannot encode {cls.__name__}: not a registered message")
    names = _NAMES_OF.get(cls)
    if names is None:
        names = _NAMES_OF[cls] = tuple([f.name for f in fields(cls)])  # type: ignore[arg-type]
    return [tag, *[getattr(obj, name) for name in names]]


def encode(msg: object) -> bytes:
    """Serialize a registered message to msgpack bytes.

    Strings go as they are, lone surrogates included: JSON lets a client send "\\ud800" in a
    request id or a stop string, and that must not make the message unsendable.
    """
    return msgpack.packb(msg, default=_pack_default, unicode_errors="surrogatepass")


def decode(data: bytes) -> object:
    """Parse bytes made by `encode`; raises WireError on anything else."""
    try:
        obj = msgpack.unpackb(data, unicode_errors="surrogatepass")
    except (ValueError, msgpack.UnpackException) as exc:
        raise WireError(f"not a msgpack message: {exc}") from None
    return _decode_any(obj, "message")


def _decode_any(obj: Any, where: str) -> object:
    if not (type(obj) is list and obj and type(obj[0]) is int):
        raise WireError(f"{where}: expected [tag, fields...], got {_show(obj)}")
    return _decoder(obj[0], where)(obj, where)


def _decoder(tag: int, where: str) -> Callable[[list[Any], str], Any]:
    decoder = _DECODERS.get(tag)
    if decoder is None:
        if tag not in _CLASS_OF:
            raise WireError(f"{where}: unknown message tag {tag}")
        decoder = _DECODERS[tag] = _make_decoder(_CLASS_OF[tag])
    return decoder


def _make_decoder(cls: type) -> Callable[[list[Any], str], Any]:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in fields(cls)]
    checks = [_check_for(hints[name]) for name in names]
    name = cls.__name__

    def decode_fields(obj: list[Any], where: str) -> Any:
        if len(obj) != len(names) + 1:
            raise WireError(f"{name}: expected {len(names)} fields, got {len(obj) - 1}")
        values = [
            check(v, f"{name}.{n}") for check, v, n in zip(checks, obj[1:], names, strict=True)
        ]
        try:
            return cls(*values)
        except ValueError as exc:  # the class's own validation (e.g. SamplingParams)
            raise WireError(f"{name}: {exc}") from None

    return decode_fields


def _check_for(tp: Any) -> Check:
    """Build a function that validates one decoded field against type `tp` (and converts it)."""
    if tp is int:
        return _check_int
    if tp is float:
        return _check_float
    if tp in (str, bool, bytes):
        return _check_exact(tp)
    if is_dataclass(tp) and tp in _TAG_OF:
        return _check_message(tp)
    if isinstance(tp, type) and tp not in _TAG_OF:  # a base class: any of its messages
        return _check_kind(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return _check_tuple(args[0])
    if origin is tuple and Ellipsis not in args:
        return _check_record([_check_for(a) for a in args])
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return _check_optional(_check_for(inner))
    raise TypeError(f"no wire codec for field type {tp!r}")


def _check_int(v: Any, where: str) -> int:
    if type(v) is not int:
        raise WireError(f"{where}: expected int, got {_show(v)}")
    return v


def _check_float(v: Any, where: str) -> float:
    if type(v) is float:
        return v
    if type(v) is int:
        return float(v)
    raise WireError(f"{where}: expected float, got {_show(v)}")


def _check_exact(tp: type) -> Check:
    def check(v: Any, where: str) -> Any:
        if type(v) is not tp:
            raise WireError(f"{where}: expected {tp.__name__}, got {_show(v)}")
        return v

    return check


def _check_message(cls: type) -> Check:
    tag = _TAG_OF[cls]

    def check(v: Any, where: str) -> Any:
        if not (type(v) is list and v and v[0] == tag):
            raise WireError(f"{where}: expected {cls.__name__}, got {_show(v)}")
        return _decoder(tag, where)(v, where)

    return check


def _check_kind(base: type) -> Check:
    """A field typed by a base class (e.g. `ControlOp`): any registered message of its kind."""

    def check(v: Any, where: str) -> Any:
        cls = _CLASS_OF.get(v[0]) if type(v) is list and v and type(v[0]) is int else None
        if cls is None or not issubclass(cls, base):
            raise WireError(f"{where}: expected a {base.__name__}, got {_show(v)}")
        return _decoder(v[0], where)(v, where)

    return check


def _check_tuple(item_tp: Any) -> Check:
    if item_tp is int:  # the hot case (token ids, seq ids): one pass, no per-item call

        def check_ints(v: Any, where: str) -> tuple[int, ...]:
            if type(v) is not list:
                raise WireError(f"{where}: expected a list, got {_show(v)}")
            for i, x in enumerate(v):
                if type(x) is not int:
                    raise WireError(f"{where}[{i}]: expected int, got {_show(x)}")
            return tuple(v)

        return check_ints
    check_item = _check_for(item_tp)

    def check(v: Any, where: str) -> tuple[Any, ...]:
        if type(v) is not list:
            raise WireError(f"{where}: expected a list, got {_show(v)}")
        return tuple([check_item(x, f"{where}[{i}]") for i, x in enumerate(v)])

    return check


def _check_record(check_items: list[Check]) -> Check:
    """A fixed-length tuple such as `tuple[int, float]`."""

    def check(v: Any, where: str) -> tuple[Any, ...]:
        if type(v) is not list or len(v) != len(check_items):
            raise WireError(f"{where}: expected a list of {len(check_items)}, got {_show(v)}")
        pairs = enumerate(zip(check_items, v, strict=True))
        return tuple([check_item(x, f"{where}[{i}]") for i, (check_item, x) in pairs])

    return check


def _check_optional(check_inner: Check) -> Check:
    def check(v: Any, where: str) -> Any:
        return None if v is None else check_inner(v, where)

    return check


def _show(v: Any) -> str:
    text = repr(v)
    return f"{type(v).__name__} {text if len(text) <= 40 else text[:37] + '...'}"
