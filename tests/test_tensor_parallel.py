"""Tensor parallelism end to end: each worker split over two ranks (`tensor_parallel_size=2`)
talking gloo over loopback, real actors, float32, against transformers' greedy tokens."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from runtime.cli_parser import build_parser
from runtime.config import EngineConfig
from runtime.engine_client import EngineDeadError
from runtime.frontend.engine import Engine
from runtime.frontend.launch import open_engine
from runtime.layers.parallel import TPGroup
from runtime.sampling_params import SamplingParams
from runtime.supervisor import ActorDiedError
from runtime.worker import shard_follower
from runtime.worker.shard_follower import RankStartError
from tests.conftest import ARCHS
from tests.engine_helpers import collect, collect_all
from tests.parity_helpers import GREEDY, SHARED, prompt_set


def tp_config(model: Path, mode: str = "inproc", **changes: object) -> EngineConfig:
    config = EngineConfig(
        model=str(model),
        mode=mode,  # type: ignore[arg-type]
        dtype="float32",  # transformers computes the references in float32
        max_model_len=512,
        max_num_batched_tokens=256,  # the prompts need several chunked steps
        num_kv_blocks=40,  # ~2,300 prompt tokens in flight for 640 slots: preemption
        tensor_parallel_size=2,
        num_threads=1,
    )
    return config.replace(**changes)


@pytest.mark.parametrize("mode", ["inproc", "process"])
@pytest.mark.parametrize("arch", ARCHS)
async def test_two_ranks_give_transformers_tokens_with_prefix_hits_and_preemption(
    model_dirs: dict[str, Path], references: dict[str, list[list[int]]], arch: str, mode: str
) -> None:
    async with open_engine(tp_config(model_dirs[arch], mode)) as engine:
        warm = await collect(engine, SHARED, GREEDY)  # puts the shared prefix in the cache
        results = await collect_all(engine, prompt_set(), GREEDY)
        stats = await engine.fetch_statistics()
        info = engine.server_info()
    assert warm["tokens"] == references[arch][0]
    assert [r["tokens"] for r in results] == references[arch][1:]
    assert stats.scheduler.num_cached_tokens > 0 and stats.scheduler.num_preemptions > 0
    assert stats.scheduler.num_free_blocks == 40
    assert info["tensor_parallel_size"] == 2


async def test_a_dead_rank_fails_every_request_and_takes_the_engine_down(
    llama_dir: Path,
) -> None:
    errors: list[EngineDeadError] = []
    died = pytest.RaisesExc(ActorDiedError, match="the worker-tp1 process exited with code -9")

    async def long_request(engine: Engine, started: trio.Event) -> None:
        try:
            async for _ in engine.generate([1, 2, 3], SamplingParams(max_tokens=400)):
                started.set()
        except EngineDeadError as exc:
            errors.append(exc)

    with pytest.RaisesGroup(died, flatten_subgroups=True):
        async with open_engine(tp_config(llama_dir, "process")) as engine:
            assert set(engine.processes) == {"scheduler", "worker", "worker-tp1"}
            async with trio.open_nursery() as nursery:
                started = trio.Event()
                nursery.start_soon(long_request, engine, started)
                await started.wait()
                engine.processes["worker-tp1"].kill()
    assert len(errors) == 1 and "worker-tp1 process exited with code -9" in str(errors[0])


async def test_a_rank_that_cannot_start_names_itself_and_the_cause(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = shard_follower.ModelRunner

    def runner(config: EngineConfig, progress: bool, tp: TPGroup, device: object) -> object:
        if tp.rank == 1:
            raise MemoryError("no room for the weights")
        return real(config, progress, tp, device)  # type: ignore[arg-type]

    monkeypatch.setattr(shard_follower, "ModelRunner", runner)
    with pytest.raises(BaseExceptionGroup) as raised:
        async with open_engine(tp_config(llama_dir)):
            pass
    errors = list(flatten(raised.value))  # rank 0's, and rank 1's unless abandoned first
    assert all(isinstance(e, RankStartError) for e in errors), errors
    cause = "tensor-parallel rank 1 (cpu) could not start: MemoryError: no room for the weights"
    assert {str(e) for e in errors} == {cause}


def flatten(group: BaseExceptionGroup) -> Iterator[BaseException]:
    for exc in group.exceptions:
        yield from flatten(exc) if isinstance(exc, BaseExceptionGroup) else [exc]


async def test_weight_and_memory_changes_are_refused_not_half_done(llama_dir: Path) -> None:
    async with open_engine(tp_config(llama_dir)) as engine:
        success, message, _ = await engine.update_weights_from_disk(str(llama_dir))
        assert not success and "not available with --tensor-parallel-size > 1" in message
        with pytest.raises(ValueError, match="not available with tensor parallelism"):
            await engine.get_weights_by_name("model.norm.weight", 4)
        with pytest.raises(ValueError, match="not available with --tensor-parallel-size"):
            await engine.release_memory_occupation()
        result = await collect(engine, SHARED, GREEDY)  # still serving, on the old weights
        assert result["tokens"]


def test_the_size_is_checked_and_has_vllms_and_sglangs_flags() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size must be positive, got 0"):
        EngineConfig(model="unused", tensor_parallel_size=0)
    for flag in ("--tensor-parallel-size", "--tp-size"):
        assert build_parser().parse_args(["serve", flag, "2"]).tensor_parallel_size == 2
