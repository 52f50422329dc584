"""Helpers for tests of the engine: prompts, collecting outputs, and `fake_engine` (the real
frontend and scheduler actor with tests/fake_worker.py's model-free worker, in memory)."""

from __future__ import annotations

import functools
import math
import random
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from runtime.checkpoints.model_info import ModelInfo, load_model_info
from runtime.config.engine import EngineConfig
from runtime.config.sampling import SamplingParams
from runtime.frontend.engine import Engine
from runtime.protocol import RequestOutput
from tests.fake_worker import start_actors

NUM_BLOCKS = 24  # fake_engine's KV pool


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = 4096) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


async def collect(engine: Engine, prompt: list[int] | str, params: SamplingParams) -> dict:
    """Run one request to the end; return its tokens, text, finish reason and cache hits."""
    return await consume(engine.generate(prompt, params))


async def consume(outputs: AsyncGenerator[RequestOutput, None]) -> dict:
    """A request's outputs joined (with n > 1: sample 0's; `consume_samples` has them all)."""
    return (await consume_samples(outputs))[0]


async def consume_samples(outputs: AsyncGenerator[RequestOutput, None]) -> list[dict]:
    """Each sample's outputs joined, by sample index."""
    samples: dict[int, dict] = {}
    async for out in outputs:
        sample = samples.setdefault(
            out.index,
            {"tokens": [], "logprobs": [], "text": "", "top_logprobs": [], "prompt_logprobs": None},
        )
        sample["tokens"] += out.token_ids
        sample["logprobs"] += out.logprobs
        sample["text"] += out.text
        sample["top_logprobs"] += out.top_logprobs or []
        sample["prompt_logprobs"] = sample["prompt_logprobs"] or out.prompt_logprobs
        sample["finish_reason"] = out.finish_reason
        sample["matched_stop"] = out.matched_stop
        sample["num_cached_tokens"] = out.num_cached_tokens
    return [samples[i] for i in sorted(samples)]


async def collect_all(
    engine: Engine,
    prompts: list,
    params: SamplingParams | None,
    *,
    params_each: list[SamplingParams] | None = None,
) -> list[dict]:
    """Submit every prompt at once, in order (one task each), and wait for all of them."""
    results: list[dict] = [{}] * len(prompts)
    each = params_each or [params or SamplingParams()] * len(prompts)
    requests = [engine.generate(prompt, p) for prompt, p in zip(prompts, each, strict=True)]

    async def one(i: int) -> None:
        results[i] = await consume(requests[i])

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    return results


@functools.cache
def model_files(model: str) -> tuple[ModelInfo, PreTrainedTokenizerBase]:
    info = load_model_info(EngineConfig(model=model))
    return info, AutoTokenizer.from_pretrained(model)


@asynccontextmanager
async def fake_engine(
    model: Path, depth: int, hang_after: float = math.inf
) -> AsyncIterator[Engine]:
    """The real engine (frontend and scheduler actor) with the model-free worker: every run
    is deterministic, and trio's autojump clock works."""
    config = EngineConfig(
        model=str(model),
        mode="inproc",
        max_model_len=64,
        block_size=4,
        max_num_seqs=3,
        max_num_batched_tokens=12,
        max_steps_in_flight=depth,
    )
    info, tokenizer = model_files(str(model))
    engine = Engine(config, info, tokenizer)
    async with trio.open_nursery() as nursery:
        frontend = start_actors(nursery, config, info.eos_token_ids, NUM_BLOCKS, hang_after)
        await nursery.start(engine.run, frontend)
        yield engine
        nursery.cancel_scope.cancel()
