"""Data parallelism end to end: two scheduler+worker groups behind one frontend
(`data_parallel_size=2`), real actors, the tiny llama in float32."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pytest
import trio

from runtime.cli.parser import build_parser
from runtime.config.engine import EngineConfig
from runtime.config.sampling import SamplingParams
from runtime.frontend.engine import Engine
from runtime.frontend.launch import open_engine
from runtime.processes.supervisor import ActorDiedError
from runtime.protocol import EngineDeadError, SessionParams
from tests.engine_helpers import collect, collect_all, consume, consume_samples
from tests.parity_helpers import GREEDY, SHARED, prompt_set


def dp_config(
    model: Path, mode: Literal["inproc", "process"] = "inproc", **changes: object
) -> EngineConfig:
    config = EngineConfig(
        model=str(model),
        mode=mode,
        dtype="float32",  # transformers computes the references in float32
        max_model_len=512,
        max_num_batched_tokens=256,  # the prompts need several chunked steps
        data_parallel_size=2,
        num_threads=1,
    )
    return config.replace(**changes)


def file_names(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir())


def generated(engine: Engine) -> list[int]:
    return [rank.scheduler.num_generated_tokens for rank in engine.statistics().per_rank()]


async def test_two_groups_give_transformers_tokens_and_share_the_work(
    llama_dir: Path, references: dict[str, list[list[int]]]
) -> None:
    async with open_engine(dp_config(llama_dir, num_kv_blocks=40)) as engine:
        warm = await collect(engine, SHARED, GREEDY)  # group 0 now holds the shared prefix
        results = await collect_all(engine, prompt_set(), GREEDY)
        stats = await engine.fetch_statistics()
        loads = engine.get_loads()
        info = engine.server_info()
    assert warm["tokens"] == references["llama"][0]
    assert [r["tokens"] for r in results] == references["llama"][1:]
    first, *_ = stats.ranks
    assert [rank.dp_rank for rank in stats.ranks] == [0, 1]
    assert all(rank.scheduler.num_generated_tokens > 100 for rank in stats.ranks)
    assert sum(rank.scheduler.num_generated_tokens for rank in stats.ranks) == 17 * 16
    # the prefix pulled the first prompts that share it to group 0, whose cache had it
    hits = [r["num_cached_tokens"] for r in results]
    assert hits[0] == hits[3] == 80 and first.scheduler.num_cached_tokens >= 240, hits
    assert stats.scheduler.num_free_blocks == 80 and stats.kv_cache_usage == 0.0
    assert [load["dp_rank"] for load in loads] == [0, 1]
    assert [load["max_total_num_tokens"] for load in loads] == [640, 640]
    assert info["num_kv_blocks"] == 80 and info["data_parallel_size"] == 2


async def test_steering_samples_and_sessions_across_groups(llama_dir: Path, tmp_path: Path) -> None:
    async with open_engine(dp_config(llama_dir)) as engine:
        await collect(engine, [5] * 40, GREEDY)  # group 0 has more load history; both idle
        before = generated(engine)
        samples = await consume_samples(
            engine.generate([7] * 20, SamplingParams(n=2, max_tokens=5, temperature=0.0))
        )
        after = generated(engine)
        assert samples[0]["tokens"] == samples[1]["tokens"]
        assert sorted(a - b for a, b in zip(after, before, strict=True)) == [0, 10]

        sid = engine.open_session(4096)
        for i in range(3):  # every turn lands where the session opened
            before = generated(engine)
            turn = SamplingParams(max_tokens=4, temperature=0.0)
            await consume(engine.generate([9 + i] * 8, turn, session=SessionParams(sid)))
            moved = [a - b for a, b in zip(generated(engine), before, strict=True)]
            assert sorted(moved) == [0, 4], moved
        engine.close_session(sid)

        await engine.control.pause("keep")
        await engine.control.resume()
        await engine.control.set_internal_state({"max_num_seqs": 3})
        stats = await engine.fetch_statistics()
        assert [r.scheduler.max_num_seqs for r in stats.ranks] == [3, 3]
        assert engine.server_info()["max_num_seqs"] == 3
        await engine.control.flush_cache()
        success, message, _ = await engine.weights.update_weights_from_disk(str(llama_dir))
        assert success, message
        values = await engine.weights.get_weights_by_name("model.norm.weight", 4)
        assert len(values) == 4
        with pytest.raises(ValueError, match="no parameter"):
            await engine.weights.get_weights_by_name("nope", 4)
        await engine.control.start_profile(str(tmp_path))
        await collect_all(engine, [[3] * 30, [4] * 30], SamplingParams(max_tokens=3))
        await engine.control.stop_profile()
        await engine.check_health()
    names = file_names(tmp_path)
    # the workers share this process, and its one torch profile: the first to start it
    # records (its own steps), the other writes nothing; starting both at once must not crash
    assert len([name for name in names if name.startswith("worker-dp")]) == 1
    assert [name for name in names if not name.startswith("worker")] == [
        "frontend-rank0.trace.json",
        "scheduler-dp0-rank0.trace.json",
        "scheduler-dp1-rank0.trace.json",
    ]


async def test_a_dead_group_fails_every_request_and_takes_the_engine_down(
    llama_dir: Path,
) -> None:
    errors: list[EngineDeadError] = []
    died = pytest.RaisesExc(ActorDiedError, match="the worker-dp1 process exited with code -9")

    async def long_request(engine: Engine, prompt: list[int], started: trio.Event) -> None:
        try:
            async for _ in engine.generate(prompt, SamplingParams(max_tokens=400)):
                started.set()
        except EngineDeadError as exc:
            errors.append(exc)

    with pytest.RaisesGroup(died, flatten_subgroups=True):
        async with open_engine(dp_config(llama_dir, "process")) as engine:
            assert set(engine.processes) == {
                "scheduler-dp0", "worker-dp0", "scheduler-dp1", "worker-dp1"
            }  # fmt: skip
            async with trio.open_nursery() as nursery:
                started = [trio.Event(), trio.Event()]
                for prompt, event in zip(([1, 2, 3], [4, 5, 6]), started, strict=True):
                    nursery.start_soon(long_request, engine, prompt, event)  # one per group
                for event in started:
                    await event.wait()
                assert min(generated(engine)) > 0
                engine.processes["worker-dp1"].kill()
    assert len(errors) == 2
    assert all("the worker-dp1 process exited with code -9" in str(e) for e in errors)


def test_the_size_is_checked_and_has_vllms_and_sglangs_flags() -> None:
    with pytest.raises(ValueError, match="data_parallel_size must be positive, got 0"):
        EngineConfig(model="unused", data_parallel_size=0)
    for flag in ("--data-parallel-size", "--dp-size"):
        assert build_parser().parse_args(["serve", flag, "3"]).data_parallel_size == 3
