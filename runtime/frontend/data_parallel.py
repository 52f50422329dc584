"""Data parallelism: N scheduler+worker groups behind the one frontend, seen by the engine as
one channel to one scheduler.

The engine does not know there are several groups. This channel sits between it and the
groups' channels, and keeps the protocol's promises for each of them:

- a new request goes to one group (`Router`: least load, or a cached prefix worth more than
  the difference); its samples (n > 1) and a session's turns go where their first went; an
  abort goes to the request's group;
- pings and control messages go to every group, and their answers come back as one: a
  `Pong` with every group's statistics added up, a `ControlDone` with each group's error
  named by its rank (`dp_rank 1: ...`), or the one error all groups gave;
- the groups' step outputs pass up as they come, their statistics replaced by the sums
  (`ranks` keeps each group's own, for `/v1/loads` and the metrics);
- `EngineReady` passes up once every group has sent its own.

A weight change (an update, or resumed weights) that succeeds in some groups and fails in
others would have the groups serve different models: that is fatal (`GroupsDivergedError`),
like an actor's death. A group that dies takes the engine down the same way: the server
never half-serves.

Per step this costs a handful of dict operations per sequence; with one group the engine
talks to the scheduler's channel directly and pays nothing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import trio

from runtime.frontend.router import Router
from runtime.protocol import RankStats
from runtime.wire.codec import WireError
from runtime.wire.control import Control, ControlDone, FanOut
from runtime.wire.messages import (
    AddRequest,
    EngineReady,
    OpenSession,
    Ping,
    Pong,
    Probe,
    Rejected,
    ReleaseTurns,
    SchedulerStats,
    StepOutputs,
    Submit,
    WorkerStats,
)
from runtime.wire.transport import MessageChannel

Stats = TypeVar("Stats", SchedulerStats, WorkerStats)


@dataclass(frozen=True, slots=True)
class _Broken:
    error: Exception


class GroupsDivergedError(RuntimeError):
    """A weight change succeeded in some data-parallel groups and failed in others."""


class DataParallelChannel(MessageChannel):
    def __init__(self, channels: Sequence[MessageChannel], block_size: int) -> None:
        self._channels = list(channels)
        size = len(channels)
        self._router = Router(size, block_size)
        self._loads = [0] * size  # tokens of each group's open requests (the router's load)
        self._open: dict[str, list[int]] = {}  # request id -> [group, tokens in its load]
        self._sessions: dict[str, int] = {}  # session key -> its group
        self._answers: dict[int, _Gathering] = {}  # by nonce: calls awaiting their answers
        self._readies: list[EngineReady | None] = [None] * size
        self._schedulers = [SchedulerStats.idle(0)] * size
        self._workers = [WorkerStats()] * size
        self._prompt_tokens = [0] * size
        self._inbox_send, self._inbox = trio.open_memory_channel[object](math.inf)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Receive from every group until cancelled (`recv` reads what this passes up)."""
        async with trio.open_nursery() as nursery:
            for group in range(len(self._channels)):
                nursery.start_soon(self._receive_from, group)
            task_status.started()

    def ranks(self) -> tuple[RankStats, ...]:
        """Each group's latest statistics."""
        return tuple(
            RankStats(group, scheduler, worker, prompt_tokens)
            for group, (scheduler, worker, prompt_tokens) in enumerate(
                zip(self._schedulers, self._workers, self._prompt_tokens, strict=True)
            )
        )

    async def recv(self) -> object:
        """The next message for the engine; raises what broke a group's receiving (a
        `GroupsDivergedError`, a closed socket), so the engine dies of the real cause."""
        msg = await self._inbox.receive()
        if isinstance(msg, _Broken):
            raise msg.error
        return msg

    async def send(self, msg: object) -> None:
        match msg:
            case Submit():
                for group, part in self._split(msg).items():
                    await self._channels[group].send(part)
            case Control(nonce=nonce, op=op):
                if op.drops_prefix_cache:
                    self._router.forget()
                groups = [0] if op.fan_out is FanOut.ONE_GROUP else range(len(self._channels))
                self._answers[nonce] = _Gathering(len(groups), op.changes_weights)
                for group in groups:
                    await self._channels[group].send(Control(nonce, op.for_group(group)))
            case Ping(nonce=nonce) | Probe(nonce=nonce):
                self._answers[nonce] = _Gathering(len(self._channels))
                for channel in self._channels:
                    await channel.send(msg)
            case OpenSession(session=key):
                chosen = self._sessions[key] = self._router.least_loaded(self._loads)
                await self._channels[chosen].send(msg)
            case ReleaseTurns(session=key, close=close):
                owner = self._sessions.pop(key, None) if close else self._sessions.get(key)
                if owner is not None:  # else no group keeps anything of it
                    await self._channels[owner].send(msg)
            case _:
                raise WireError(f"no group to send a {type(msg).__name__} to")

    def _split(self, submit: Submit) -> dict[int, Submit]:
        """Each group's part of a `Submit`, in the original order."""
        adds: dict[int, list[AddRequest]] = {}
        aborts: dict[int, list[str]] = {}
        for add in submit.adds:
            adds.setdefault(self._route(add), []).append(add)
        for rid in submit.aborts:
            entry = self._open.pop(rid, None)
            if entry is not None:  # else it ended already: nothing is left to abort
                group, tokens = entry
                self._loads[group] -= tokens
                aborts.setdefault(group, []).append(rid)
        return {
            group: Submit(tuple(adds.get(group, ())), tuple(aborts.get(group, ())))
            for group in sorted(adds.keys() | aborts.keys())
        }

    def _route(self, add: AddRequest) -> int:
        prompt = add.prompt_token_ids
        sibling = self._open.get(add.fork_of) if add.fork_of else None
        if sibling is not None:  # a sample of n > 1: where its prompt's KV is
            group, tokens = sibling[0], 0
        elif add.session in self._sessions:
            group, tokens = self._sessions[add.session], len(prompt)
        else:
            group, tokens = self._router.route(prompt, self._loads), len(prompt)
        self._open[add.rid] = [group, tokens]
        self._loads[group] += tokens
        self._prompt_tokens[group] += tokens
        return group

    async def _receive_from(self, group: int) -> None:
        try:
            while True:
                msg = await self._channels[group].recv()
                passed = self._received(group, msg)
                if passed is not None:
                    self._inbox_send.send_nowait(passed)
        except Exception as exc:  # the engine's receive loop raises it, then everything stops
            self._inbox_send.send_nowait(_Broken(exc))

    def _received(self, group: int, msg: object) -> object | None:
        """What the engine gets for `msg` from `group`: None until a combined answer is whole."""
        match msg:
            case StepOutputs():
                self._schedulers[group], self._workers[group] = msg.scheduler, msg.worker
                self._count_outputs(group, msg)
                return dataclasses.replace(
                    msg, scheduler=_add_up(self._schedulers), worker=_add_up(self._workers)
                )
            case Rejected(rid=rid):
                entry = self._open.pop(rid, None)
                if entry is not None:
                    self._loads[group] -= entry[1]
                return msg
            case Pong(nonce=nonce) | ControlDone(nonce=nonce):
                if isinstance(msg, Pong) and msg.scheduler is not None:
                    self._schedulers[group] = msg.scheduler
                if isinstance(msg, Pong) and msg.worker is not None:
                    self._workers[group] = msg.worker
                return self._combine(nonce, group, msg)
            case EngineReady():
                return self._ready(group, msg)
            case _:
                return msg  # the engine says what is wrong with it

    def _count_outputs(self, group: int, msg: StepOutputs) -> None:
        """Each token generated adds to its group's load; a finished request leaves it."""
        for rid, finish_reason in zip(msg.rids, msg.finish_reasons, strict=True):
            entry = self._open.get(rid)
            if entry is None:
                continue
            if finish_reason is None:
                entry[1] += 1
                self._loads[group] += 1
            else:
                del self._open[rid]
                self._loads[group] -= entry[1]

    def _combine(self, nonce: int, group: int, msg: Pong | ControlDone) -> object | None:
        gathering = self._answers.get(nonce)
        if gathering is None:
            raise WireError(f"an answer from dp_rank {group} to a call nobody made ({nonce})")
        gathering.answers.append((group, msg))
        if len(gathering.answers) < gathering.expected:
            return None
        del self._answers[nonce]
        if isinstance(msg, Pong):
            return self._combined_pong(nonce, [answer for _, answer in gathering.answers])
        return _combined_done(nonce, gathering)

    def _combined_pong(self, nonce: int, pongs: list[object]) -> Pong:
        with_stats = all(isinstance(p, Pong) and p.scheduler is not None for p in pongs)
        if not with_stats:  # a `Probe`'s answers: schedulers only
            return Pong(nonce, None, None)
        return Pong(nonce, _add_up(self._schedulers), _add_up(self._workers))

    def _ready(self, group: int, ready: EngineReady) -> EngineReady | None:
        self._readies[group] = ready
        self._schedulers[group] = SchedulerStats.idle(ready.worker.num_kv_blocks)
        readies = [r for r in self._readies if r is not None]
        if len(readies) < len(self._readies):
            return None
        blocks = sum(r.worker.num_kv_blocks for r in readies)
        return dataclasses.replace(
            readies[0], worker=dataclasses.replace(readies[0].worker, num_kv_blocks=blocks)
        )


def _add_up(stats: list[Stats]) -> Stats:
    """Statistics of several groups as one: every figure is a count, a gauge or seconds."""
    first = stats[0]
    totals = {
        field.name: sum(getattr(s, field.name) for s in stats)
        for field in dataclasses.fields(first)
    }
    return type(first)(**totals)


@dataclass(slots=True)
class _Gathering:
    """A call sent to `expected` groups, and the answers that came back so far."""

    expected: int
    changes_weights: bool = False
    answers: list[tuple[int, object]] = field(default_factory=list)


def _combined_done(nonce: int, gathering: _Gathering) -> ControlDone:
    """The groups' answers as one: success, the one error all gave, or each error named."""
    answers = gathering.answers
    if len(answers) == 1:
        return answers[0][1]  # type: ignore[return-value]
    errors = sorted(
        (group, answer.error)
        for group, answer in answers
        if isinstance(answer, ControlDone) and answer.error
    )
    if gathering.changes_weights and 0 < len(errors) < len(answers):
        raise GroupsDivergedError(
            "a weight change failed in some data-parallel groups only, which would "
            f"serve different weights: {_named(errors)}"
        )
    if not errors:
        return ControlDone(nonce, "")
    if len(errors) == len(answers) and len({error for _, error in errors}) == 1:
        return ControlDone(nonce, errors[0][1])
    return ControlDone(nonce, _named(errors))


def _named(errors: list[tuple[int, str]]) -> str:
    return "; ".join(f"dp_rank {group}: {error}" for group, error in errors)
