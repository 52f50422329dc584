"""Structured output in the engine (its actors in this process, on the tiny llama): a
preempted sequence is recomputed without its matcher advancing twice, the n samples of a
request each follow their own, tensor parallelism masks on the rank that samples, and the
engine API refuses a bad constraint as the request starts, serving on."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

from runtime.config.constraint import Constraint
from runtime.config.engine import EngineConfig
from runtime.config.sampling import SamplingParams
from runtime.frontend.launch import open_engine
from runtime.protocol import EngineStats
from tests.engine_helpers import consume_samples, random_prompts

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
    },
    "required": ["id", "tags", "name"],
    "additionalProperties": False,
}
JSON = Constraint("json", json.dumps(SCHEMA), compact=True)
PROMPT = random_prompts([100], seed=9)[0]


def config(llama_dir: Path, **changes: object) -> EngineConfig:
    return EngineConfig(
        model=str(llama_dir), mode="inproc", dtype="float32", max_model_len=256
    ).replace(**changes)


async def run(config: EngineConfig, params: SamplingParams) -> tuple[list[dict], EngineStats]:
    async with open_engine(config) as engine:
        samples = await consume_samples(engine.generate(PROMPT, params))
        return samples, await engine.fetch_statistics()


def check_json(samples: list[dict]) -> None:
    for sample in samples:
        assert sample["finish_reason"] == "stop", sample["text"]
        jsonschema.validate(json.loads(sample["text"]), SCHEMA)


async def test_preemption_recomputes_without_advancing_a_matcher_twice(llama_dir: Path) -> None:
    """Seeded samples draw the same numbers whatever happens to their sequence, so with a
    KV pool too small for them all they must come out as they do with room to spare: a
    matcher fed a token twice would forbid the right continuation."""
    params = SamplingParams(max_tokens=100, temperature=1.0, seed=3, n=6, constraint=JSON)
    roomy, at_ease = await run(config(llama_dir), params)
    tight, squeezed = await run(config(llama_dir, num_kv_blocks=16), params)
    assert at_ease.scheduler.num_preemptions == 0 < squeezed.scheduler.num_preemptions
    assert [s["tokens"] for s in tight] == [s["tokens"] for s in roomy]
    assert len({s["text"] for s in roomy}) > 1  # each sample followed its own matcher
    check_json(roomy)


async def test_tensor_parallel_ranks_mask_where_they_sample(llama_dir: Path) -> None:
    params = SamplingParams(max_tokens=100, temperature=0.0, constraint=JSON)
    one, _ = await run(config(llama_dir), params)
    two, _ = await run(config(llama_dir, tensor_parallel_size=2, num_threads=1), params)
    assert two[0]["tokens"] == one[0]["tokens"]
    check_json(two)


async def test_the_engine_api_refuses_a_bad_constraint_and_serves_on(llama_dir: Path) -> None:
    async with open_engine(config(llama_dir)) as engine:
        bad = SamplingParams(max_tokens=4, constraint=Constraint("regex", "(unclosed"))
        with pytest.raises(ValueError, match="the regex"):
            await engine.compile_constraint(bad.constraint)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="the regex"):  # generate compiles it itself
            await consume_samples(engine.generate(PROMPT, bad))
        digits = SamplingParams(max_tokens=8, constraint=Constraint("regex", "[0-9]{3}"))
        (sample,) = await consume_samples(engine.generate(PROMPT, digits))
        assert sample["text"].isdigit() and len(sample["text"]) == 3
        stats = await engine.fetch_statistics()
    assert stats.frontend.num_requests_open == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
async def test_masks_apply_on_cuda(llama_dir: Path) -> None:
    """The GPU path (benchmarks/device_check.sh): masks made on the host, applied to the
    logits on the device, CUDA-graph decode steps and the Triton sampler in between."""
    greedy = SamplingParams(max_tokens=100, temperature=0.0, constraint=JSON)
    on_cpu, _ = await run(config(llama_dir), greedy)
    cuda = config(llama_dir, device="cuda", attention_backend="triton")
    on_gpu, _ = await run(cuda, greedy)
    assert on_gpu[0]["tokens"] == on_cpu[0]["tokens"]
    sampled, _ = await run(cuda, greedy.replace(temperature=1.0, seed=5, n=4))
    check_json(on_gpu + sampled)
