"""Every message the actors exchange, and the one msgpack codec that carries them.

A message is a frozen, slotted dataclass registered under a small integer tag. On the wire it is
the msgpack array `[tag, field0, field1, ...]`; nested messages nest the same way. Decoding checks
every field against the class's type hints, so a peer speaking another version, or garbage, gets a
`WireError` naming the message, the field and what was wrong, never a half-built object.

Hot messages (`StepPlan`, `StepResult`, `StepOutputs`) are columnar: one tuple per field, one
entry per sequence, so a step costs one message per direction whatever the batch size.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, TypeVar, dataclass_transform

import msgpack

from runtime.sampling_params import SamplingParams

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


# ---------------------------------------------------------------------------------------------
# Messages. Tags are part of the protocol between processes: never reuse or renumber one.

register(1)(SamplingParams)


@message(2)
class AddRequest:
    """Frontend → scheduler: a new request with its prompt already tokenized."""

    rid: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams


@message(3)
class Submit:
    """Frontend → scheduler: everything the frontend queued since its last message."""

    adds: tuple[AddRequest, ...]
    aborts: tuple[str, ...]


@message(4)
class Ping:
    """Health probe, answered by a `Pong` with its nonce once every actor on the path saw it."""

    nonce: int


@message(5)
class Pong:
    """Answer to `Ping`. The scheduler attaches its statistics as it relays the worker's pong."""

    nonce: int
    stats: SchedulerStats | None


@message(10)
class NewSeq:
    """Scheduler → worker: a sequence the worker has no state for (new, or back from preemption)."""

    seq_id: int
    token_ids: tuple[int, ...]
    num_prompt_tokens: int
    num_computed_tokens: int
    params: SamplingParams


@message(11)
class StepPlan:
    """Scheduler → worker: one engine step.

    `seq_ids[i]` computes its next `num_tokens[i]` tokens; a token is sampled for it when that
    reaches the end of its known tokens. `block_ids[j]` is appended to the block table of
    `block_seq_ids[j]`, in order. `released` sequences are gone: the worker drops their state.
    """

    step: int
    new_seqs: tuple[NewSeq, ...]
    seq_ids: tuple[int, ...]
    num_tokens: tuple[int, ...]
    block_seq_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    released: tuple[int, ...]
    queued: bool  # sent while an earlier step computed: the worker should find it waiting


@message(12)
class WorkerReady:
    """Worker → scheduler, once: the model is loaded and the KV pool holds this many blocks."""

    num_kv_blocks: int


@message(13)
class StepTimings:
    """Seconds the worker spent on one step, by phase."""

    prepare: float
    forward: float
    sample: float
    idle: float  # between the end of the previous step and receiving this plan


@message(14)
class StepResult:
    """Worker → scheduler: the token sampled for each sequence that finished its chunk."""

    step: int
    seq_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    timings: StepTimings


@message(20)
class EngineReady:
    """Scheduler → frontend, once: the engine accepts requests."""

    num_kv_blocks: int
    max_model_len: int


@message(21)
class SchedulerStats:
    """Gauges (now) and counters (since start) of the scheduler and its worker."""

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    num_steps: int
    num_preemptions: int
    num_aborts: int  # abort messages received, including ones for already finished requests
    num_generated_tokens: int
    num_cached_tokens: int
    schedule_seconds: float
    update_seconds: float
    wait_seconds: float  # the scheduler waiting for results
    prepare_seconds: float
    forward_seconds: float
    sample_seconds: float
    worker_idle_seconds: float  # the worker waiting for plans

    @classmethod
    def idle(cls, num_blocks: int) -> SchedulerStats:
        """The figures of an engine that has done nothing yet."""
        return cls(0, 0, num_blocks, num_blocks, 0, 0, 0, 0, 0, *[0.0] * 7)


@message(22)
class StepOutputs:
    """Scheduler → frontend: every request's new token from one step (or only fresh stats).

    `finish_reasons[i]` is None while request `rids[i]` runs, else "stop" or "length".
    `num_cached_tokens[i]` is how many prompt tokens the prefix cache supplied.
    """

    rids: tuple[str, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reasons: tuple[str | None, ...]
    num_cached_tokens: tuple[int, ...]
    stats: SchedulerStats


# ---------------------------------------------------------------------------------------------
# Codec.


def _pack_default(obj: object) -> list[Any]:
    tag = _TAG_OF.get(type(obj))
    if tag is None:
        raise TypeError(f"cannot encode {type(obj).__name__}: not a registered message")
    return [tag, *(getattr(obj, f.name) for f in fields(obj))]  # type: ignore[arg-type]


def encode(msg: object) -> bytes:
    """Serialize a registered message to msgpack bytes."""
    return msgpack.packb(msg, default=_pack_default)


def decode(data: bytes) -> object:
    """Parse bytes made by `encode`; raises WireError on anything else."""
    try:
        obj = msgpack.unpackb(data)
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
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return _check_tuple(args[0])
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
        return tuple(check_item(x, f"{where}[{i}]") for i, x in enumerate(v))

    return check


def _check_optional(check_inner: Check) -> Check:
    def check(v: Any, where: str) -> Any:
        return None if v is None else check_inner(v, where)

    return check


def _show(v: Any) -> str:
    text = repr(v)
    return f"{type(v).__name__} {text if len(text) <= 40 else text[:37] + '...'}"
