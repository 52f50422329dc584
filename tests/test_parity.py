"""Greedy outputs equal transformers' generate(do_sample=False), token for token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.config.engine import EngineConfig
from runtime.config.sampling import SamplingParams
from runtime.frontend.launch import open_engine
from tests.conftest import ARCHS
from tests.engine_helpers import collect, collect_all, random_prompts
from tests.parity_helpers import GREEDY, SHARED, prompt_set

# the compiled CPU kernels (the default) in both modes, and the torch reference path
PATHS = [("inproc", "cpp"), ("process", "auto"), ("inproc", "torch")]


@pytest.mark.parametrize(("mode", "backend"), PATHS)
@pytest.mark.parametrize("arch", ARCHS)
async def test_greedy_parity_with_prefix_cache_and_chunked_prefill(
    model_dirs: dict[str, Path],
    references: dict[str, list[list[int]]],
    arch: str,
    mode: str,
    backend: str,
) -> None:
    config = EngineConfig(
        dtype="float32",  # transformers computes the references in float32
        model=str(model_dirs[arch]),
        mode=mode,
        attention_backend=backend,  # type: ignore[arg-type]
        max_model_len=512,
        max_num_batched_tokens=256,
    )  # 16 prompts need several chunked steps
    async with open_engine(config) as engine:
        ran = engine.server_info()["attention_backend"]  # read back from the worker
        assert ran == ("torch" if backend == "torch" else "cpp")  # "auto" on CPU: cpp
        warm = await collect(engine, SHARED, GREEDY)  # puts the shared prefix in the cache
        results = await collect_all(engine, prompt_set(), GREEDY)
        stats = await engine.fetch_statistics()
    assert warm["tokens"] == references[arch][0]
    assert [r["tokens"] for r in results] == references[arch][1:]
    hits = [r["num_cached_tokens"] for r in results]
    assert all(hits[i] >= 64 for i in range(0, len(hits), 3)), hits
    assert stats.scheduler.num_cached_tokens >= 64 * 6
    assert stats.kv_cache_usage == 0.0


@pytest.mark.parametrize(("mode", "backend"), PATHS)
@pytest.mark.parametrize("arch", ARCHS)
async def test_greedy_parity_under_preemption(
    model_dirs: dict[str, Path],
    references: dict[str, list[list[int]]],
    arch: str,
    mode: str,
    backend: str,
) -> None:
    # 40 blocks of 16 = 640 tokens for ~2,300 prompt tokens in flight: preemption is certain
    config = EngineConfig(
        dtype="float32",  # transformers computes the references in float32
        model=str(model_dirs[arch]),
        mode=mode,
        attention_backend=backend,  # type: ignore[arg-type]
        max_model_len=512,
        num_kv_blocks=40,  # prefix caching on: a recomputed sequence may revive its own blocks
    )
    async with open_engine(config) as engine:
        results = await collect_all(engine, prompt_set(), GREEDY)
        stats = await engine.fetch_statistics()
    assert [r["tokens"] for r in results] == references[arch][1:]
    assert stats.scheduler.num_preemptions > 0 and stats.scheduler.num_cached_tokens > 0
    assert stats.scheduler.num_free_blocks == 40


async def test_greedy_parity_without_a_step_queued_ahead(
    model_dirs: dict[str, Path], references: dict[str, list[list[int]]]
) -> None:
    """max_steps_in_flight=1 (schedule only after each result) gives the same tokens."""
    config = EngineConfig(
        model=str(model_dirs["llama"]),
        mode="inproc",
        max_model_len=512,
        dtype="float32",
        num_kv_blocks=40,
        max_steps_in_flight=1,
    )
    async with open_engine(config) as engine:
        results = await collect_all(engine, prompt_set(), GREEDY)
    assert [r["tokens"] for r in results] == references["llama"][1:]


# in the interpreter one architecture takes a minute; the kernels see the same calls in all three
TRITON_ARCHS = ARCHS if torch.cuda.is_available() else ("llama",)


@pytest.mark.parametrize("arch", TRITON_ARCHS)
async def test_triton_kernels_greedy_parity(
    model_dirs: dict[str, Path], references: dict[str, list[list[int]]], arch: str
) -> None:
    """The Triton kernels (on the CPU in Triton's interpreter, tests/conftest.py; on CUDA in
    benchmarks/device_check.sh): prefix hits, a prompt whose last token alone is new (a
    decode row), prefill chunks over cached prefixes; fewer prompts than the tests above,
    because the interpreter runs each kernel program in Python."""
    picked = [0, 12]  # 81 and 230 tokens, both starting with SHARED
    config = EngineConfig(
        dtype="float32",
        model=str(model_dirs[arch]),
        mode="inproc",
        device="cuda" if torch.cuda.is_available() else "cpu",
        attention_backend="triton",
        max_model_len=512,
        max_num_batched_tokens=64,  # the 230-token prompt takes four chunks
    )
    async with open_engine(config) as engine:
        assert engine.server_info()["attention_backend"] == "triton"
        warm = await collect(engine, SHARED, GREEDY)
        prompts = prompt_set()
        results = await collect_all(engine, [prompts[i] for i in picked], GREEDY)
    assert warm["tokens"] == references[arch][0]
    assert [r["tokens"] for r in results] == [references[arch][1 + i] for i in picked]
    assert all(r["num_cached_tokens"] >= 80 for r in results), results


async def test_triton_sampling_draws_what_the_torch_sampler_draws(
    model_dirs: dict[str, Path],
) -> None:
    """Seeded requests with every filter: the Triton sampler (no sort) picks the tokens the
    torch sampler picks, given the same model (float32) and the same per-request seeds."""
    prompts = random_prompts([12, 30], seed=5)
    params_each = [
        SamplingParams(max_tokens=8, temperature=0.8, top_k=20, top_p=0.9, seed=3),
        SamplingParams(max_tokens=8, temperature=1.2, min_p=0.05, seed=4),
    ]
    runs = []
    for backend in ("torch", "triton"):
        config = EngineConfig(
            dtype="float32",
            model=str(model_dirs["llama"]),
            mode="inproc",
            device="cuda" if torch.cuda.is_available() else "cpu",
            attention_backend=backend,  # type: ignore[arg-type]
            max_model_len=128,
        )
        async with open_engine(config) as engine:
            results = await collect_all(engine, prompts, None, params_each=params_each)
        runs.append([r["tokens"] for r in results])
    assert runs[0] == runs[1]
    assert all(len(tokens) == 8 for tokens in runs[0])
