"""The data-parallel channel (runtime/frontend/data_parallel.py) against fake groups: where
each message goes, and how the groups' answers come back as one."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio

from runtime.config.sampling import SamplingParams
from runtime.frontend.data_parallel import DataParallelChannel, GroupsDivergedError
from runtime.wire.control import (
    Control,
    ControlDone,
    FlushCache,
    GetWeights,
    JoinWeightGroup,
    UpdateWeights,
)
from runtime.wire.messages import (
    AddRequest,
    EngineReady,
    OpenSession,
    Ping,
    Pong,
    ReleaseTurns,
    SchedulerStats,
    StepOutputs,
    Submit,
    WorkerReady,
    WorkerStats,
)


class FakeGroup:
    """A group's end of the channel: what it was sent, and a way to answer."""

    def __init__(self) -> None:
        self.sent: list[object] = []
        self._answers_send, self._answers = trio.open_memory_channel[object](math.inf)

    async def send(self, msg: object) -> None:
        self.sent.append(msg)

    async def recv(self) -> object:
        return await self._answers.receive()

    def answer(self, msg: object) -> None:
        self._answers_send.send_nowait(msg)


@asynccontextmanager
async def two_groups() -> AsyncIterator[tuple[DataParallelChannel, list[FakeGroup]]]:
    groups = [FakeGroup(), FakeGroup()]
    channel = DataParallelChannel(groups, block_size=4)
    async with trio.open_nursery() as nursery:
        await nursery.start(channel.run)
        for blocks, group in zip((10, 20), groups, strict=True):
            group.answer(EngineReady(64, 2, WorkerReady(blocks, "float32", 1, 100)))
        ready = await channel.recv()
        assert isinstance(ready, EngineReady) and ready.worker.num_kv_blocks == 30
        yield channel, groups
        nursery.cancel_scope.cancel()


def add(rid: str, length: int, fork_of: str = "", session: str = "") -> AddRequest:
    return AddRequest(rid, tuple(range(length)), 8, SamplingParams(), session, fork_of)


def stats(running: int) -> SchedulerStats:
    return dataclasses.replace(SchedulerStats.idle(10), num_running=running)


async def test_requests_are_balanced_and_their_samples_and_aborts_follow_them() -> None:
    async with two_groups() as (channel, groups):
        await channel.send(Submit((add("a", 10), add("a.1", 10, fork_of="a"), add("b", 3)), ()))
        assert groups[0].sent == [Submit((add("a", 10), add("a.1", 10, fork_of="a")), ())]
        assert groups[1].sent == [Submit((add("b", 3),), ())]
        await channel.send(Submit((add("c", 2),), ("a", "gone")))  # c: 3 + 2 < 10
        assert groups[0].sent[-1] == Submit((), ("a",))
        assert groups[1].sent[-1] == Submit((add("c", 2),), ())
        assert [r.prompt_tokens_total for r in channel.ranks()] == [10, 5]


async def test_finished_requests_leave_the_load() -> None:
    async with two_groups() as (channel, groups):
        await channel.send(Submit((add("a", 10), add("b", 3)), ()))
        outputs = StepOutputs(("a",), (5,), (0.0,), ("stop",), (0,), stats(1), WorkerStats())
        groups[0].answer(outputs)
        passed = await channel.recv()
        assert isinstance(passed, StepOutputs) and passed.rids == ("a",)
        assert passed.scheduler.num_running == 1 and passed.scheduler.num_total_blocks == 30
        await channel.send(Submit((add("c", 2),), ()))  # group 0 is empty again
        assert groups[0].sent[-1] == Submit((add("c", 2),), ())


async def test_a_session_stays_with_its_group() -> None:
    async with two_groups() as (channel, groups):
        await channel.send(Submit((add("x", 50),), ()))  # group 0 is busy
        await channel.send(OpenSession("s"))
        await channel.send(Submit((add("t1", 2, session="s"),), ()))
        await channel.send(ReleaseTurns("s", ("t1",), True))
        assert groups[1].sent[0] == OpenSession("s")
        assert groups[1].sent[1] == Submit((add("t1", 2, session="s"),), ())
        assert groups[1].sent[2] == ReleaseTurns("s", ("t1",), True)


async def test_pings_go_to_every_group_and_come_back_as_one_sum() -> None:
    async with two_groups() as (channel, groups):
        await channel.send(Ping(7))
        assert groups[0].sent == groups[1].sent == [Ping(7)]
        groups[1].answer(Pong(7, stats(2), WorkerStats(num_steps=5)))
        groups[0].answer(Pong(7, stats(1), WorkerStats(num_steps=3)))
        pong = await channel.recv()
        assert isinstance(pong, Pong) and pong.nonce == 7
        assert pong.scheduler is not None and pong.scheduler.num_running == 3
        assert pong.worker == WorkerStats(num_steps=8)
        assert [r.scheduler.num_running for r in channel.ranks()] == [1, 2]


async def test_control_errors_are_named_by_rank_unless_every_group_gave_the_same() -> None:
    async with two_groups() as (channel, groups):
        await channel.send(Control(1, FlushCache(False)))
        groups[0].answer(ControlDone(1, "2 requests are open"))
        groups[1].answer(ControlDone(1, ""))
        assert await channel.recv() == ControlDone(1, "dp_rank 0: 2 requests are open")
        await channel.send(Control(2, FlushCache(False)))
        for group in groups:
            group.answer(ControlDone(2, "no"))
        assert await channel.recv() == ControlDone(2, "no")


async def test_a_weight_update_that_fails_in_one_group_only_is_fatal() -> None:
    async with two_groups() as (channel, groups):
        await channel.send(Control(3, UpdateWeights("/new")))
        groups[0].answer(ControlDone(3, ""))
        groups[1].answer(ControlDone(3, "disk full"))
        with pytest.raises(GroupsDivergedError, match="dp_rank 1: disk full"):
            await channel.recv()  # the engine dies of it


async def test_trainer_ranks_and_weight_reads() -> None:
    async with two_groups() as (channel, groups):
        await channel.send(Control(4, JoinWeightGroup("g", "127.0.0.1", 1234, 1, 3, "gloo")))
        assert [g.sent[0].op.rank_offset for g in groups] == [1, 2]  # type: ignore[attr-defined]
        await channel.send(Control(5, GetWeights("w", 3)))
        assert groups[1].sent[-1] != Control(5, GetWeights("w", 3))
        groups[0].answer(ControlDone(5, "", (1.0, 2.0, 3.0)))
        assert await channel.recv() == ControlDone(5, "", (1.0, 2.0, 3.0))
