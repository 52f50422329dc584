"""What sampling options cost: decode step time at one batch size with each option, and n
samples of one prompt against as many separate requests.

    python -m benchmarks.sampling [--model DIR] [--batch 32] [--n 8] [--prompt-len 512]

Step time is measured while every request of the batch decodes (as benchmarks/decode_throughput
does), split into the worker's forward and sampling. For n, one request with `n` samples and
`n` separate requests of the same prompt run from an idle engine with prefix caching off, so
that only the fork shares the prompt: the prompt tokens each computed, and the throughput.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import trio

from benchmarks.decode_throughput import run_batch
from runtime.checkpoints.builtin import builtin_model_dir
from runtime.config.engine import EngineConfig
from runtime.config.sampling import SamplingParams
from runtime.frontend.engine import Engine
from runtime.frontend.launch import open_engine

VARIANTS: dict[str, dict[str, Any]] = {
    "none": {},
    "logprobs=5": {"logprobs": 5},
    "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1},
    "logit_bias+min_tokens": {"logit_bias": ((7, 2.0), (9, -2.0)), "min_tokens": 8},
    "all of them": {
        "logprobs": 5,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "repetition_penalty": 1.1,
        "logit_bias": ((7, 2.0), (9, -2.0)),
        "min_tokens": 8,
    },
}


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 4000) for _ in range(length)] for _ in range(count)]


async def decode_steps(
    engine: Engine, batch: int, output_len: int, options: dict[str, Any]
) -> dict:
    params = SamplingParams(temperature=1.0, seed=0, **options)
    return await run_batch(engine, batch, 32, output_len, params)


async def samples_of_one_prompt(
    engine: Engine, n: int, prompt_len: int, output_len: int, forked: bool
) -> dict:
    (prompt,) = prompts(1, prompt_len, 7)
    params = SamplingParams(max_tokens=output_len, temperature=1.0, seed=1, ignore_eos=True)
    before = await engine.fetch_statistics()
    started = time.perf_counter()

    async def request(p: SamplingParams) -> None:
        async for _ in engine.generate(prompt, p):
            pass

    async with trio.open_nursery() as nursery:
        if forked:
            nursery.start_soon(request, params.replace(n=n))
        else:
            for i in range(n):
                nursery.start_soon(request, params.replace(seed=1 + i))
    elapsed = time.perf_counter() - started
    after = await engine.fetch_statistics()
    cached = after.scheduler.num_cached_tokens - before.scheduler.num_cached_tokens
    tokens = after.scheduler.num_generated_tokens - before.scheduler.num_generated_tokens
    return {
        "prompt_tokens_computed": n * prompt_len - cached,
        "tokens_per_s": tokens / elapsed,
        "seconds": elapsed,
    }


async def main_async(args: argparse.Namespace) -> None:
    model = args.model or str(builtin_model_dir())
    config = EngineConfig(
        model=model,
        mode=args.mode,
        max_num_seqs=max(args.batch, args.n),
        dtype=args.dtype,
        enable_prefix_caching=False,  # n: only the fork shares the prompt
        max_model_len=args.prompt_len + args.output_len,
    )
    async with open_engine(config) as engine:
        await decode_steps(engine, 4, 16, {})  # warm-up: first-call costs
        ran = engine.ready  # what the actors report they run, not what we asked for
        assert ran is not None
        info = engine.server_info()
        print(
            f"model={model} mode={args.mode} dtype={ran.worker.dtype} "
            f"threads={ran.worker.num_threads} in_flight={ran.max_steps_in_flight} "
            f"logprobs_mode={info['logprobs_mode']} prefix_caching={info['enable_prefix_caching']}"
        )
        print(f"decode at batch {args.batch}, {args.output_len} tokens each (ms per step):")
        print(f"{'options':>22} {'step':>7} {'forward':>8} {'sample':>7} {'tok/s':>7}")
        for name, options in VARIANTS.items():
            r = await decode_steps(engine, args.batch, args.output_len, options)
            print(
                f"{name:>22} {r['step_ms']:>7.2f} {r['forward']:>8.2f} {r['sample']:>7.2f} "
                f"{r['tokens_per_s']:>7.0f}"
            )
        print(
            f"one prompt of {args.prompt_len} tokens, {args.n} samples of {args.output_len} tokens:"
        )
        for label, forked in ((f"n={args.n}", True), (f"{args.n} requests", False)):
            r = await samples_of_one_prompt(
                engine, args.n, args.prompt_len, args.output_len, forked
            )
            print(
                f"{label:>22} prompt tokens computed {r['prompt_tokens_computed']:>6}  "
                f"{r['tokens_per_s']:>6.0f} tok/s  {r['seconds']:.2f} s"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint directory (default: the built-in model)")
    parser.add_argument("--mode", choices=["process", "inproc"], default="process")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )
    trio.run(main_async, parser.parse_args())


if __name__ == "__main__":
    main()
