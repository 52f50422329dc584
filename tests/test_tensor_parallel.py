"""Tensor parallelism end to end: each worker split over two ranks (`tensor_parallel_size=2`)
talking gloo over loopback, real actors, float32, against transformers' greedy tokens."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import trio
from safetensors import safe_open
from safetensors.torch import save_file

from runtime.cli.parser import build_parser
from runtime.config.engine import EngineConfig
from runtime.config.sampling import SamplingParams
from runtime.frontend.engine import Engine
from runtime.frontend.launch import open_engine
from runtime.layers import parallel
from runtime.layers.parallel import TPGroup
from runtime.processes.supervisor import ActorDiedError
from runtime.protocol import EngineDeadError, PoolingParams
from runtime.wire.messages import ShardStep
from runtime.worker import shard_follower, tp_group
from runtime.worker.model_runner import ModelRunner
from runtime.worker.served_weights import ServedWeights
from tests.conftest import ARCHS
from tests.engine_helpers import collect, collect_all
from tests.parity_helpers import GREEDY, SHARED, last_hidden_states, prompt_set


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


async def test_ranks_idle_longer_than_any_timeout_still_serve(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The group's own timeout and the step timeout are 1 s here; waiting for the next step
    is not a collective that can time out (gloo fails an operation at the group's timeout
    unless the operation says otherwise)."""
    monkeypatch.setattr(tp_group, "JOIN_TIMEOUT", timedelta(seconds=1))
    monkeypatch.setattr(parallel, "STEP_TIMEOUT", timedelta(seconds=1))
    async with open_engine(tp_config(llama_dir)) as engine:
        first = await collect(engine, SHARED, GREEDY)
        await trio.sleep(2.5)  # real time: gloo's clock, not trio's, would time out
        assert (await collect(engine, SHARED, GREEDY))["tokens"] == first["tokens"]


async def test_a_rank_that_hangs_is_a_dead_engine_after_the_step_timeout(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(parallel, "STEP_TIMEOUT", timedelta(seconds=1))
    release = threading.Event()
    real = ModelRunner.follow

    def follow(self: ModelRunner, step: ShardStep) -> None:
        if step.plan.step >= 3:
            release.wait(30)  # hangs (until the test is over)
        real(self, step)

    monkeypatch.setattr(ModelRunner, "follow", follow)
    errors: list[EngineDeadError] = []
    hung = pytest.RaisesExc(
        ActorDiedError, match="the worker actor failed: TPGroupError: tensor-parallel rank 0"
    )
    try:
        with pytest.RaisesGroup(hung, flatten_subgroups=True):
            async with open_engine(tp_config(llama_dir)) as engine:
                try:
                    await collect(engine, [1, 2, 3], SamplingParams(max_tokens=50))
                except EngineDeadError as exc:
                    errors.append(exc)
    finally:
        release.set()
    assert len(errors) == 1 and "a rank died or hangs" in str(errors[0])


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
    cause = "tensor-parallel rank 1: could not start on cpu: MemoryError: no room for the weights"
    assert errors and all(isinstance(e, ActorDiedError) for e in errors), errors
    assert {str(e).split("RankStartError: ")[1] for e in errors} == {cause}


async def test_ranks_with_unequal_kv_pools_refuse_to_start(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scheduler plans one pool for every rank: a rank with fewer blocks (a smaller
    GPU under --gpu-memory-utilization) would be handed block ids past its pool's end."""
    real = shard_follower.ModelRunner

    def runner(config: EngineConfig, progress: bool, tp: TPGroup, device: object) -> object:
        built = real(config, progress, tp, device)  # type: ignore[arg-type]
        built.num_blocks -= tp.rank  # rank 1: one block fewer
        return built

    monkeypatch.setattr(shard_follower, "ModelRunner", runner)
    with pytest.raises(BaseExceptionGroup) as raised:
        async with open_engine(tp_config(llama_dir)):
            pass
    errors = list(flatten(raised.value))
    assert errors and all("the ranks' KV pools differ" in str(e) for e in errors), errors


def flatten(group: BaseExceptionGroup) -> Iterator[BaseException]:
    for exc in group.exceptions:
        yield from flatten(exc) if isinstance(exc, BaseExceptionGroup) else [exc]


# (name, values): spans rows on both ranks where the split is by rows (q: rank 1 from row 128
# of 256), several rows where it is by columns (o, down), and whole tensors on every rank
WEIGHTS = [
    ("model.embed_tokens.weight", 700),
    ("model.layers.0.self_attn.q_proj.weight", 40_000),
    ("model.layers.1.self_attn.v_proj.weight", 20_000),
    ("model.layers.0.self_attn.o_proj.weight", 600),
    ("model.layers.3.mlp.down_proj.weight", 1_500),
    ("model.layers.2.mlp.up_proj.weight", 100),
    ("model.norm.weight", 256),
]


def checkpoint_values(model_dir: Path, name: str, count: int) -> list[float]:
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return f.get_tensor(name).flatten()[:count].float().tolist()


async def test_weights_and_memory_change_on_every_rank_or_on_none(
    llama_dir: Path, tmp_path: Path
) -> None:
    async with open_engine(tp_config(llama_dir)) as engine:
        for name, count in WEIGHTS:  # reassembled from both ranks' shares
            values = await engine.weights.get_weights_by_name(name, count)
            assert values == checkpoint_values(llama_dir, name, count), name
        with pytest.raises(ValueError, match="no parameter"):
            await engine.weights.get_weights_by_name("model.nope.weight", 4)
        before = await collect(engine, SHARED, GREEDY)

        success, message, _ = await engine.weights.update_weights_from_disk(str(tmp_path / "none"))
        assert not success and "tensor-parallel rank 0: " in message
        success, message, _ = await engine.weights.update_weights_from_disk(str(llama_dir))
        assert success, message

        name = "model.layers.0.self_attn.q_proj.weight"  # rows on both ranks
        new = torch.full((256, 256), 0.5)
        success, message = await engine.weights.update_weights_from_tensor({name: new})
        assert success, message
        assert await engine.weights.get_weights_by_name(name, 40_000) == [0.5] * 40_000
        success, message = await engine.weights.update_weights_from_tensor({name: torch.ones(3, 3)})
        assert not success and "shape (3, 3)" in message
        success, message, _ = await engine.weights.update_weights_from_disk(str(llama_dir))
        assert success, message

        await engine.control.release_memory_occupation()
        await engine.control.resume_memory_occupation()
        after = await collect(engine, SHARED, GREEDY)
    assert after["tokens"] == before["tokens"]


async def test_a_failed_update_names_the_rank_and_leaves_every_rank_on_the_old_weights(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """qwen2 (its one KV head on both ranks): a checkpoint that does not load changes no
    rank, and the answer names the first rank that refused it."""
    qwen2 = model_dirs["qwen2"]
    broken = tmp_path / "broken"
    shutil.copytree(qwen2, broken)
    with safe_open(str(qwen2 / "model.safetensors"), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"][:-2]
    save_file(tensors, str(broken / "model.safetensors"))
    async with open_engine(tp_config(qwen2)) as engine:
        name = "model.layers.0.self_attn.k_proj.weight"  # the replicated KV head
        assert await engine.weights.get_weights_by_name(name, 50) == checkpoint_values(
            qwen2, name, 50
        )
        before = await collect(engine, SHARED, GREEDY)
        success, message, _ = await engine.weights.update_weights_from_disk(str(broken))
        assert not success and "tensor-parallel rank 0: CheckpointError" in message, message
        assert "embed_tokens" in message
        assert (await collect(engine, SHARED, GREEDY))["tokens"] == before["tokens"]


async def test_an_update_that_one_rank_refuses_changes_no_rank(
    llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = "model.layers.0.self_attn.q_proj.weight"  # rank 0's rows change if it commits
    other = tmp_path / "other"
    shutil.copytree(llama_dir, other)
    with safe_open(str(llama_dir / "model.safetensors"), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    tensors[name] = tensors[name] * 2
    save_file(tensors, str(other / "model.safetensors"))
    real = ServedWeights.candidate

    def candidate(self: ServedWeights, model_dir: str) -> tuple[object, str]:
        if self.shape.tp.rank == 1:
            return None, "OSError: disk gone"
        return real(self, model_dir)

    monkeypatch.setattr(ServedWeights, "candidate", candidate)
    async with open_engine(tp_config(llama_dir)) as engine:
        success, message, _ = await engine.weights.update_weights_from_disk(str(other))
        assert not success and "tensor-parallel rank 1: OSError: disk gone" in message, message
        values = await engine.weights.get_weights_by_name(name, 40_000)
    assert values == checkpoint_values(llama_dir, name, 40_000)


async def test_a_trainers_weight_group_is_refused_not_half_joined(llama_dir: Path) -> None:
    async with open_engine(tp_config(llama_dir)) as engine:
        success, message = await engine.weights.init_weights_update_group("127.0.0.1", 1, 1, 2, "t")
        assert not success and "not available with --tensor-parallel-size > 1" in message


def test_the_size_is_checked_and_has_vllms_and_sglangs_flags() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size must be positive, got 0"):
        EngineConfig(model="unused", tensor_parallel_size=0)
    for flag in ("--tensor-parallel-size", "--tp-size"):
        assert build_parser().parse_args(["serve", flag, "2"]).tensor_parallel_size == 2


async def test_data_parallel_groups_of_tensor_parallel_ranks(
    llama_dir: Path, references: dict[str, list[list[int]]]
) -> None:
    config = tp_config(llama_dir, data_parallel_size=2, num_kv_blocks=0)
    async with open_engine(config) as engine:
        results = await collect_all(engine, prompt_set()[:6], GREEDY)
        embedded = await engine.embed(prompt_set()[:4], PoolingParams(pooling_type="mean"))
        stats = await engine.fetch_statistics()
        values = await engine.weights.get_weights_by_name(
            "model.layers.0.self_attn.q_proj.weight", 99
        )
    assert [r["tokens"] for r in results] == references["llama"][1:7]
    assert all(rank.scheduler.num_generated_tokens > 0 for rank in stats.ranks)
    hidden = last_hidden_states(llama_dir, prompt_set()[:4])  # pooled on rank 0 of each group
    for got, h in zip(embedded, hidden, strict=True):
        vector = torch.tensor(got.embedding)
        assert torch.nn.functional.cosine_similarity(vector, h.mean(dim=0), dim=0) >= 0.9999
    name = "model.layers.0.self_attn.q_proj.weight"
    assert values == checkpoint_values(llama_dir, name, 99)
