"""Decode throughput of the engine at several batch sizes, and where each step's time goes.

    python -m benchmarks.decode_throughput [--model DIR] [--mode process] [--batch 1 8 32 64]

For each batch size, B requests with random prompts decode `--output-len` tokens each
(ignore_eos, greedy). Throughput counts the tokens generated while every request decodes. The
split comes from the actors' statistics over the same window: scheduling (the scheduler core's
schedule and update), input preparation, model forward and sampling (worker), and the worker's
idle time: from sending one result to receiving the next plan, i.e. what messaging, scheduling
and the frontend cost the worker. With async scheduling the next plan is already waiting, so
that idle time is only the receive itself.
"""

from __future__ import annotations

import argparse
import random
import time

import trio

from runtime.checkpoints.default_model import default_model_file
from runtime.config.engine import EngineConfig
from runtime.config.sampling import SamplingParams
from runtime.frontend.engine import Engine
from runtime.frontend.launch import open_engine
from runtime.protocol import EngineStats


async def run_batch(
    engine: Engine,
    batch: int,
    prompt_len: int,
    output_len: int,
    params: SamplingParams | None = None,
) -> dict:
    """`batch` requests decoding `output_len` tokens (greedy unless `params` says otherwise);
    the figures of the window in which all of them decode."""
    rng = random.Random(batch)
    params = (params or SamplingParams(temperature=0.0)).replace(
        max_tokens=output_len, ignore_eos=True
    )
    prompts = [[rng.randrange(3, 4000) for _ in range(prompt_len)] for _ in range(batch)]
    decoding = 0
    window: dict[str, object] = {}

    async def request(prompt: list[int]) -> None:
        nonlocal decoding
        counted = False
        async for _ in engine.generate(prompt, params):
            if not counted:
                counted, decoding = True, decoding + 1
                if decoding == batch:  # every request has its first token: pure decode now
                    window["start"], window["stats"] = time.perf_counter(), engine.statistics()

    async with trio.open_nursery() as nursery:
        for prompt in prompts:
            nursery.start_soon(request, prompt)
    elapsed = time.perf_counter() - window["start"]  # type: ignore[operator]
    end = await engine.fetch_statistics()
    return summarize(batch, elapsed, window["stats"], end)  # type: ignore[arg-type]


def summarize(batch: int, elapsed: float, a: EngineStats, b: EngineStats) -> dict:
    steps = max(1, b.scheduler.num_steps - a.scheduler.num_steps)
    tokens = b.scheduler.num_generated_tokens - a.scheduler.num_generated_tokens

    def per_step(actor: str, name: str) -> float:
        after, before = getattr(getattr(b, actor), name), getattr(getattr(a, actor), name)
        return 1000 * (after - before) / steps

    return {
        "batch": batch,
        "tokens_per_s": tokens / elapsed,
        "step_ms": 1000 * elapsed / steps,
        "schedule": per_step("scheduler", "schedule_seconds")
        + per_step("scheduler", "update_seconds"),
        "prepare": per_step("worker", "prepare_seconds"),
        "forward": per_step("worker", "forward_seconds"),
        "sample": per_step("worker", "sample_seconds"),
        "worker_idle": per_step("worker", "idle_seconds"),
        "communicate": per_step("worker", "communicate_seconds"),
    }


async def main_async(args: argparse.Namespace) -> None:
    model = args.model or str(default_model_file())  # the engine converts it once
    config = EngineConfig(
        model=model,
        mode=args.mode,
        max_num_seqs=max(args.batch),
        dtype=args.dtype,
        num_threads=args.threads,
        max_steps_in_flight=args.steps_in_flight,
    )
    async with open_engine(config) as engine:
        await run_batch(engine, 4, args.prompt_len, 16)  # warm-up: first-call costs
        ran = engine.ready  # what the actors report they run, not what we asked for
        assert ran is not None
        print(
            f"model={model} mode={args.mode} dtype={ran.worker.dtype} "
            f"threads={ran.worker.num_threads} in_flight={ran.max_steps_in_flight} "
            f"kv_blocks={ran.worker.num_kv_blocks} prompt_len={args.prompt_len} "
            f"output_len={args.output_len}"
        )
        print(
            f"{'batch':>5} {'tok/s':>8} {'step ms':>8} | {'sched':>6} {'prep':>6} {'fwd':>6} "
            f"{'sample':>6} {'w.idle':>6}  (ms per step)"
        )
        for batch in args.batch:
            r = await run_batch(engine, batch, args.prompt_len, args.output_len)
            print(
                f"{r['batch']:>5} {r['tokens_per_s']:>8.0f} {r['step_ms']:>8.2f} | "
                f"{r['schedule']:>6.2f} {r['prepare']:>6.2f} {r['forward']:>6.2f} "
                f"{r['sample']:>6.2f} {r['worker_idle']:>6.2f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint directory or GGUF file (default: SmolLM2)")
    parser.add_argument("--mode", choices=["process", "inproc"], default="process")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=0, help="torch threads in the worker")
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )
    parser.add_argument("--steps-in-flight", type=int, default=2, choices=[1, 2])
    trio.run(main_async, parser.parse_args())


if __name__ == "__main__":
    main()
