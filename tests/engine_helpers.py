from __future__ import annotations

import random

import trio

from runtime.engine import Engine
from runtime.sampling_params import SamplingParams


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = 4096) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


async def collect(engine: Engine, prompt: list[int] | str, params: SamplingParams) -> dict:
    """Run one request to the end; return its tokens, finish reason and cache hits."""
    tokens: list[int] = []
    logprobs: list[float] = []
    async for out in engine.generate(prompt, params):
        tokens += out.token_ids
        logprobs += out.logprobs
    return {
        "tokens": tokens,
        "logprobs": logprobs,
        "finish_reason": out.finish_reason,
        "num_cached_tokens": out.num_cached_tokens,
    }


async def collect_all(engine: Engine, prompts: list, params: SamplingParams) -> list[dict]:
    """Submit every prompt at once (one task each) and wait for all of them."""
    results: list[dict] = [{}] * len(prompts)

    async def one(i: int) -> None:
        results[i] = await collect(engine, prompts[i], params)

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    return results
