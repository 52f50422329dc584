from __future__ import annotations

import random
from collections.abc import AsyncGenerator

import trio

from runtime.engine_client import RequestOutput
from runtime.frontend.engine import Engine
from runtime.sampling_params import SamplingParams


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = 4096) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


async def collect(engine: Engine, prompt: list[int] | str, params: SamplingParams) -> dict:
    """Run one request to the end; return its tokens, text, finish reason and cache hits."""
    return await consume(engine.generate(prompt, params))


async def consume(outputs: AsyncGenerator[RequestOutput, None]) -> dict:
    tokens: list[int] = []
    logprobs: list[float] = []
    text = ""
    async for out in outputs:
        tokens += out.token_ids
        logprobs += out.logprobs
        text += out.text
    return {
        "tokens": tokens,
        "logprobs": logprobs,
        "text": text,
        "finish_reason": out.finish_reason,
        "matched_stop": out.matched_stop,
        "num_cached_tokens": out.num_cached_tokens,
    }


async def collect_all(engine: Engine, prompts: list, params: SamplingParams) -> list[dict]:
    """Submit every prompt at once, in order (one task each), and wait for all of them."""
    results: list[dict] = [{}] * len(prompts)
    requests = [engine.generate(prompt, params) for prompt in prompts]  # fixes their order

    async def one(i: int) -> None:
        results[i] = await consume(requests[i])

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    return results
