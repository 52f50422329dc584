"""Sessions on the real engine (float32, greedy): a continued turn equals a fresh request over
the whole history, token for token, and reuses its KV; branches, rewinds, closing, timeouts."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from runtime.config.engine import EngineConfig
from runtime.config.sampling import SamplingParams
from runtime.frontend.engine import Engine
from runtime.frontend.launch import open_engine
from runtime.protocol import SessionParams
from tests.engine_helpers import collect, consume

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
FIRST = list(range(3, 40))  # 37 tokens
SECOND = [50, 51, 52, 53, 54]


@pytest.fixture
async def engine(llama_dir: Path) -> AsyncIterator[Engine]:
    config = EngineConfig(model=str(llama_dir), mode="inproc", max_model_len=512, dtype="float32")
    # a small pool: other requests evict whatever KV is not pinned
    async with open_engine(config.replace(max_sessions=2, num_kv_blocks=40)) as engine:
        yield engine


async def turn(engine: Engine, prompt: list[int], session: SessionParams, rid: str) -> dict:
    return await consume(engine.generate(prompt, GREEDY, rid=rid, session=session))


async def test_a_continued_turn_equals_a_fresh_request_over_the_history(engine: Engine) -> None:
    sid = engine.open_session(4096)
    first = await turn(engine, FIRST, SessionParams(sid), "t1")
    churn = [[100 + i] * 40 for i in range(16)]  # through every unpinned block of the pool
    for prompt in churn:
        await collect(engine, prompt, GREEDY)
    second = await turn(engine, SECOND, SessionParams(sid), "t2")
    history = FIRST + first["tokens"] + SECOND
    fresh = await collect(engine, history, GREEDY)
    assert second["tokens"] == fresh["tokens"]
    assert second["num_cached_tokens"] == 32  # the history's full blocks: 46 tokens known
    third = await turn(engine, [60], SessionParams(sid), "t3")
    assert third["num_cached_tokens"] == 48
    engine.close_session(sid)
    with pytest.raises(ValueError, match="no open session"):
        engine.generate([1], GREEDY, session=SessionParams(sid))


async def test_branches_rewinds_and_dropped_output(engine: Engine) -> None:
    sid = engine.open_session(4096)
    first = await turn(engine, FIRST, SessionParams(sid), "t1")
    await turn(engine, SECOND, SessionParams(sid), "t2")
    branch = await turn(engine, [70], SessionParams(sid, rid="t1"), "b1")  # from t1, not t2
    expected = await collect(engine, FIRST + first["tokens"] + [70], GREEDY)
    assert branch["tokens"] == expected["tokens"]
    rewind = await turn(engine, [71], SessionParams(sid, rid="t1", offset=-4), "r1")
    expected = await collect(engine, [*(FIRST + first["tokens"])[:-4], 71], GREEDY)
    assert rewind["tokens"] == expected["tokens"]
    without_output = SessionParams(sid, rid="t1", drop_previous_output=True)
    dropped = await turn(engine, [72], without_output, "d")
    expected = await collect(engine, [*FIRST, 72], GREEDY)
    assert dropped["tokens"] == expected["tokens"]
    await turn(engine, [73], SessionParams(sid, rid="t1", replace=True), "x")
    for gone in ("t2", "b1", "r1", "d"):  # t1's other continuations were replaced
        with pytest.raises(ValueError, match="is not a turn"):
            engine.generate([1], GREEDY, session=SessionParams(sid, rid=gone))
    with pytest.raises(ValueError, match="offset"):
        engine.generate([1], GREEDY, session=SessionParams(sid, rid="t1", offset=10_000))
    with pytest.raises(ValueError, match="already names a turn"):
        engine.generate([1], GREEDY, rid="t1", session=SessionParams(sid))
    engine.close_session(sid)
    await engine.fetch_statistics()
    assert (
        engine.statistics().scheduler.num_free_blocks
        == engine.statistics().scheduler.num_total_blocks
    )


async def test_capacity_and_the_cap_on_sessions(engine: Engine) -> None:
    small = engine.open_session(40)
    await turn(engine, FIRST, SessionParams(small), "t1")  # 37 + 10 = 47 tokens of history
    with pytest.raises(ValueError, match="capacity_of_str_len"):
        engine.generate([1], GREEDY, session=SessionParams(small))
    engine.open_session(100, session_id="mine")
    with pytest.raises(ValueError, match="already open"):
        engine.open_session(100, session_id="mine")
    with pytest.raises(ValueError, match="2 sessions are open"):
        engine.open_session(100)


async def test_close_while_a_turn_runs(engine: Engine) -> None:
    sid = engine.open_session(4096)
    long = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    outputs = engine.generate(FIRST, long, rid="t1", session=SessionParams(sid))
    count = 0
    async for out in outputs:
        count += len(out.token_ids)
        if count == 5:
            engine.close_session(sid)  # mid-decode: the turn's own blocks stay its own
    assert count == 60
    await engine.fetch_statistics()
    stats = engine.statistics().scheduler
    assert stats.num_free_blocks == stats.num_total_blocks


async def test_an_idle_session_times_out(engine: Engine) -> None:
    sid = engine.open_session(4096, timeout=0.5)
    await turn(engine, FIRST, SessionParams(sid), "t1")
    with trio.fail_after(10):
        while sid in engine.sessions.book._sessions:  # noqa: ASYNC110 (the reaper's own clock)
            await trio.sleep(0.05)
    await engine.fetch_statistics()
    stats = engine.statistics().scheduler
    assert stats.num_free_blocks == stats.num_total_blocks


async def test_a_preempted_turn_keeps_its_history(engine: Engine) -> None:
    """Under KV pressure the session's pins go first, then its running turn is preempted and
    recomputed: its tokens are still those of a fresh request over the history."""
    sid = engine.open_session(4096)
    first = await turn(engine, FIRST, SessionParams(sid), "t1")
    long = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    results: dict[str, dict] = {}
    running = trio.Semaphore(0)  # one release per other request that has begun to decode

    async def other(name: str, prompt: list[int]) -> None:
        outputs = engine.generate(prompt, long, rid=name)
        first = await outputs.__anext__()
        running.release()
        results[name] = await consume(outputs)
        results[name]["tokens"][:0] = first.token_ids

    async def session_turn() -> None:
        for _ in range(4):
            await running.acquire()  # the others run: the turn, newest, is preempted first
        outputs = engine.generate(SECOND, long, rid="t2", session=SessionParams(sid))
        results["t2"] = await consume(outputs)

    async with trio.open_nursery() as nursery:
        for i in range(4):
            nursery.start_soon(other, f"other{i}", [200 + i] * 150)
        nursery.start_soon(session_turn)
    stats = await engine.fetch_statistics()
    assert stats.scheduler.num_preemptions > 0
    fresh = await collect(engine, FIRST + first["tokens"] + SECOND, long)
    assert results["t2"]["tokens"] == fresh["tokens"]


async def test_a_session_reopened_under_its_id_shares_nothing(engine: Engine) -> None:
    """A turn that was running when its session closed must not land in a new session of the
    same id (found by review: it became the new session's history)."""
    engine.open_session(4096, session_id="chat")
    long = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    outputs = engine.generate(FIRST, long, rid="old", session=SessionParams("chat"))
    async for out in outputs:
        if out.token_ids and "old" in engine.sessions.book.get("chat").running:
            engine.close_session("chat")
            engine.open_session(4096, session_id="chat")
    new = await turn(engine, [9], SessionParams("chat"), "new")
    assert new["tokens"] == (await collect(engine, [9], GREEDY))["tokens"]
    engine.close_session("chat")
    await engine.fetch_statistics()
    stats = engine.statistics().scheduler
    assert stats.num_free_blocks == stats.num_total_blocks


async def test_a_replacing_turn_that_fails_leaves_a_usable_session(engine: Engine) -> None:
    sid = engine.open_session(4096)
    await turn(engine, FIRST, SessionParams(sid), "t1")
    await turn(engine, SECOND, SessionParams(sid), "t2")
    with trio.CancelScope() as scope:  # replaces t2, then its client leaves
        async for _ in engine.generate(
            [70], GREEDY, rid="t3", session=SessionParams(sid, rid="t1", replace=True)
        ):
            scope.cancel()
    after = await turn(engine, [71], SessionParams(sid), "t4")  # continues t1, t2 is gone
    assert after["num_cached_tokens"] > 0
