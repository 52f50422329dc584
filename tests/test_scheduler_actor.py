"""The scheduler actor's loop, with a fake worker over in-memory links: no model, no sockets,
no sleeps (trio's autojump clock; `wait_all_tasks_blocked` to see it come to rest)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from runtime.config.engine import EngineConfig
from runtime.config.sampling import SamplingParams
from runtime.wire.messages import (
    AddRequest,
    EngineReady,
    Ping,
    Pong,
    Rejected,
    StepOutputs,
    Submit,
)
from tests.fake_worker import VOCAB, MemoryChannel, expected_output, start_actors

EOS = 7
NUM_BLOCKS = 24


@asynccontextmanager
async def running_scheduler(depth: int) -> AsyncIterator[tuple[MemoryChannel, EngineReady]]:
    """A scheduler actor and a fake worker; yields the frontend's end and the EngineReady."""
    config = EngineConfig(
        model="unused",
        max_model_len=64,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        max_steps_in_flight=depth,
    )
    async with trio.open_nursery() as nursery:
        frontend = start_actors(nursery, config, frozenset({EOS}), NUM_BLOCKS)
        ready = await frontend.recv()
        assert isinstance(ready, EngineReady)
        yield frontend, ready
        nursery.cancel_scope.cancel()


def add(rid: str, prompt: list[int], max_tokens: int, ignore_eos: bool = False) -> AddRequest:
    return AddRequest(rid, tuple(prompt), max_tokens, SamplingParams(ignore_eos=ignore_eos))


async def outputs_until_done(
    frontend: MemoryChannel, rids: set[str]
) -> tuple[dict[str, list[int]], dict[str, str], StepOutputs]:
    """Tokens and finish reasons of `rids` from StepOutputs, until each has finished."""
    tokens: dict[str, list[int]] = {rid: [] for rid in rids}
    reasons: dict[str, str] = {}
    while set(reasons) != rids:
        msg = await frontend.recv()
        assert isinstance(msg, StepOutputs)
        for rid, token, reason in zip(msg.rids, msg.token_ids, msg.finish_reasons, strict=True):
            assert rid not in reasons, f"{rid} got a token after it finished"
            tokens[rid].append(token)
            if reason is not None:
                reasons[rid] = reason
    return tokens, reasons, msg


async def last_report(frontend: MemoryChannel, last: StepOutputs) -> StepOutputs:
    """The last message before the actor falls quiet (the autojump clock skips to then)."""
    with trio.move_on_after(60):
        while True:
            msg = await frontend.recv()
            assert isinstance(msg, StepOutputs)
            last = msg
    return last


def assert_exact_at_rest(report: StepOutputs) -> None:
    """What the frontend (and so /metrics) shows once the engine is idle is the truth."""
    assert report.scheduler.num_running == report.scheduler.num_waiting == 0
    assert report.scheduler.num_free_blocks == NUM_BLOCKS
    assert report.worker.num_steps == report.scheduler.num_steps > 0


@pytest.mark.parametrize("depth", [1, 2])
async def test_requests_get_their_tokens_and_blocks_come_back(
    depth: int, autojump_clock: trio.testing.MockClock
) -> None:
    # c stops at an EOS, last: with 2 steps in flight one more step has computed for it
    prompts = {"a": [1, 2, 3], "b": list(range(1, 30)), "c": [6, 6, 6, 6], "d": [4, 4]}
    max_tokens = {"a": 8, "b": 8, "c": 20, "d": 8}
    async with running_scheduler(depth) as (frontend, ready):
        assert ready.max_steps_in_flight == depth and ready.worker.num_kv_blocks == NUM_BLOCKS
        adds = [add(rid, p, max_tokens[rid], ignore_eos=rid == "d") for rid, p in prompts.items()]
        await frontend.send(Submit(tuple(adds), ()))
        tokens, reasons, last = await outputs_until_done(frontend, set(prompts))
        assert_exact_at_rest(await last_report(frontend, last))
        for rid, prompt in prompts.items():
            expected = expected_output(prompt, max_tokens[rid], eos=None if rid == "d" else EOS)
            assert tokens[rid] == expected, rid
        assert reasons == {"a": "length", "b": "length", "c": "stop", "d": "length"}
        await frontend.send(Ping(1))
        pong = await frontend.recv()
    assert isinstance(pong, Pong) and pong.scheduler is not None and pong.worker is not None
    assert pong.scheduler.num_free_blocks == NUM_BLOCKS
    assert pong.scheduler.num_running == pong.scheduler.num_waiting == 0
    assert pong.scheduler.num_generated_tokens == sum(len(t) for t in tokens.values())
    assert pong.worker.num_steps == pong.scheduler.num_steps > 0


@pytest.mark.parametrize("depth", [1, 2])
async def test_an_abort_stops_the_tokens_and_frees_the_blocks(
    depth: int, autojump_clock: trio.testing.MockClock
) -> None:
    async with running_scheduler(depth) as (frontend, _):
        await frontend.send(Submit((add("long", [1, 2, 3], 40, ignore_eos=True),), ()))
        first = await frontend.recv()
        while isinstance(first, StepOutputs) and not first.rids:  # the Submit's own report
            first = await frontend.recv()
        assert isinstance(first, StepOutputs) and first.rids == ("long",)
        await frontend.send(Submit((), ("long",)))
        last = await last_report(frontend, first)
    assert_exact_at_rest(last)
    assert last.scheduler.num_aborts == 1
    assert last.scheduler.num_generated_tokens <= 1 + depth


async def test_a_submit_while_idle_wakes_the_loop(autojump_clock: trio.testing.MockClock) -> None:
    async with running_scheduler(2) as (frontend, _):
        await trio.testing.wait_all_tasks_blocked()  # idle: waiting for the inbox
        await frontend.send(Submit((add("x", [9, 9], 3, ignore_eos=True),), ()))
        tokens, reasons, last = await outputs_until_done(frontend, {"x"})
    assert tokens["x"] == expected_output([9, 9], 3) and reasons["x"] == "length"
    assert last.worker.num_steps >= 3


async def test_a_request_it_cannot_serve_is_refused_alone(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Whatever one request carries, the actor answers `Rejected` and serves everyone else."""
    bad = [
        add("vocab", [1, VOCAB], 3),  # a token id the model cannot embed
        add("long", [1] * 60, 10),  # beyond max_model_len (64)
        add("empty", [], 3),
        add("good", [2, 3], 3, ignore_eos=True),
        add("good", [4, 5], 3),  # an id that is live right now
    ]
    async with running_scheduler(2) as (frontend, _):
        await frontend.send(Submit(tuple(bad), ()))
        rejected: dict[str, str] = {}
        tokens: list[int] = []
        while True:
            msg = await frontend.recv()
            if isinstance(msg, Rejected):
                rejected.setdefault(msg.rid, msg.reason)
                continue
            assert isinstance(msg, StepOutputs)
            tokens += msg.token_ids
            if "length" in msg.finish_reasons:
                break
        last = await last_report(frontend, msg)
    assert sorted(rejected) == ["empty", "good", "long", "vocab"]
    assert "already in use" in rejected["good"] and "max_model_len" in rejected["long"]
    assert tokens == expected_output([2, 3], 3)
    assert_exact_at_rest(last)
