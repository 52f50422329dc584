"""A client's request id is a label: reusing one can never crash the engine or cross streams."""

from __future__ import annotations

from contextlib import aclosing
from pathlib import Path

import pytest
import trio

from runtime.config.engine import EngineConfig
from runtime.config.sampling import SamplingParams
from runtime.frontend.engine import Engine
from runtime.frontend.launch import open_engine
from tests.engine_helpers import collect, consume

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def config(model: Path) -> EngineConfig:
    return EngineConfig(model=str(model), mode="inproc", max_model_len=512, dtype="float32")


async def reuse_at_once(engine: Engine, end: str) -> dict:
    """End a request `end`-wise ("stop" string, "break", "cancel") while its next token is
    still being computed, and reuse its id at once: the scheduler still knows the old one."""
    free = await collect(engine, [7, 8, 9], GREEDY)
    stop = free["text"][len(free["text"]) // 3 :][:2]
    params = GREEDY.replace(stop=(stop,)) if end == "stop" else GREEDY
    with trio.CancelScope() as scope:
        async with aclosing(engine.generate([7, 8, 9], params, rid="x")) as outputs:
            async for out in outputs:
                if out.token_ids and end == "break":
                    break  # as the HTTP layer does when a client disconnects
                if out.token_ids and end == "cancel":
                    scope.cancel()
    return await consume(engine.generate([1, 2, 3], GREEDY, rid="x"))


@pytest.mark.parametrize("end", ["stop", "break", "cancel"])
async def test_an_id_can_be_reused_as_soon_as_its_request_ended(llama_dir: Path, end: str) -> None:
    async with open_engine(config(llama_dir)) as engine:
        expected = await collect(engine, [1, 2, 3], GREEDY)
        for _ in range(3):
            reused = await reuse_at_once(engine, end)
            assert reused["tokens"] == expected["tokens"]  # its own tokens, nobody else's
        with trio.fail_after(10):
            await engine.check_health()  # still alive
        stats = await engine.fetch_statistics()
    assert stats.kv_cache_usage == 0.0


async def test_two_requests_with_one_id_at_the_same_instant(llama_dir: Path) -> None:
    """Both pass `generate`; the second to start is refused, and the first is unharmed."""
    async with open_engine(config(llama_dir)) as engine:
        expected = await collect(engine, [4, 5], GREEDY)
        results: dict[int, object] = {}

        async def run(i: int) -> None:
            try:
                results[i] = await consume(engine.generate([4, 5], GREEDY, rid="same"))
            except ValueError as exc:
                results[i] = exc

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, 0)
            nursery.start_soon(run, 1)
        refused = [r for r in results.values() if isinstance(r, ValueError)]
        served = [r for r in results.values() if isinstance(r, dict)]
        assert len(refused) == 1 and "already in use" in str(refused[0])
        assert len(served) == 1 and served[0]["tokens"] == expected["tokens"]
        stats = await engine.fetch_statistics()
    assert stats.kv_cache_usage == 0.0
