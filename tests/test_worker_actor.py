"""The worker actor on a real (tiny, random) model over an in-memory link: what it sends back
keeps the order of what it got, and a plan that waited in its queue computes what it would
have alone."""

from __future__ import annotations

from pathlib import Path

import trio

from runtime.config.engine import EngineConfig
from runtime.config.sampling import SamplingParams
from runtime.wire.messages import NewSeq, Ping, Pong, StepPlan, StepResult, WorkerReady
from runtime.worker.actor import WorkerActor
from tests.fake_worker import memory_pipe

PROMPT = (5, 6, 7, 8)


def prefill(step: int, seq_id: int) -> StepPlan:
    params = SamplingParams(temperature=0)
    new = NewSeq(seq_id, PROMPT, len(PROMPT), 0, params)
    return StepPlan(step, (new,), (seq_id,), (len(PROMPT),), (seq_id,), (seq_id,), (), False)


def decode(step: int, seq_id: int) -> StepPlan:
    return StepPlan(step, (), (seq_id,), (1,), (), (), (), True)


async def test_queued_plans_answer_in_order_and_a_ping_waits_for_them(llama_dir: Path) -> None:
    config = EngineConfig(model=str(llama_dir), mode="inproc", max_model_len=64, dtype="float32")
    worker = WorkerActor(config.replace(num_kv_blocks=4))
    scheduler, worker_end = memory_pipe()
    async with trio.open_nursery() as nursery:
        await nursery.start(worker.run, worker_end)
        ready = await scheduler.recv()
        assert isinstance(ready, WorkerReady)
        # two sequences, each prefilled and then decoded twice, every plan sent at once
        plans = [prefill(0, 0), prefill(1, 1)] + [decode(2 + i, i % 2) for i in range(4)]
        for plan in plans:
            await scheduler.send(plan)
        await scheduler.send(Ping(7))
        await scheduler.send(decode(6, 0))
        got = [await scheduler.recv() for _ in range(len(plans) + 2)]
        nursery.cancel_scope.cancel()
    results = [msg for msg in got if isinstance(msg, StepResult)]
    assert [msg.step for msg in got[: len(plans)]] == list(range(len(plans)))
    pong = got[len(plans)]
    assert isinstance(pong, Pong) and pong.nonce == 7
    assert pong.worker is not None and pong.worker.num_steps == len(plans)  # all done first
    assert isinstance(got[-1], StepResult) and got[-1].step == len(plans)
    assert [msg.seq_ids for msg in results] == [(0,), (1,), (0,), (1,), (0,), (1,), (0,)]
    assert got[-1].stats.num_steps == len(plans) + 1


async def test_steps_match_the_same_steps_one_at_a_time(llama_dir: Path) -> None:
    """The tokens do not depend on whether a plan waited in the worker's queue."""

    async def tokens(all_at_once: bool) -> list[tuple[int, ...]]:
        config = EngineConfig(model=str(llama_dir), mode="inproc", max_model_len=64)
        worker = WorkerActor(config.replace(dtype="float32", num_kv_blocks=4))
        scheduler, worker_end = memory_pipe()
        plans = [prefill(0, 0)] + [decode(1 + i, 0) for i in range(5)]
        out = []
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run, worker_end)
            await scheduler.recv()  # WorkerReady
            for plan in plans:
                await scheduler.send(plan)
                if not all_at_once:
                    out.append(await scheduler.recv())
            while len(out) < len(plans):
                out.append(await scheduler.recv())
            nursery.cancel_scope.cancel()
        assert all(isinstance(msg, StepResult) for msg in out)
        return [msg.token_ids for msg in out]  # type: ignore[attr-defined]

    assert await tokens(all_at_once=True) == await tokens(all_at_once=False)
