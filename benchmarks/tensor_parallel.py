"""Tensor parallelism: decode step time with the model on one rank against split over two.

    python -m benchmarks.tensor_parallel [--model DIR] [--batch 1 8 32] [--rounds 2]

For each round, and each of `--sizes` (default 1 then 2), an engine starts in process mode
with one torch thread per rank, and `run_batch` (benchmarks/decode_throughput.py) runs B
requests decoding `--output-len` tokens each. Each line prints what the engine ran (read back
from it), the step time, and how much of rank 0's step it spent in collectives with the other
rank (gloo all-reduces, the logits gather, the plan broadcast). Rounds alternate the sizes so
the machine's drift hits both alike.

Tensor parallelism pays where one rank's matmuls are the step (large models, fast links);
on a few CPU cores with a small model it costs: every layer adds two all-reduces over
loopback, and both ranks share the cores with the scheduler and the frontend.
"""

from __future__ import annotations

import argparse
import os

import trio

from benchmarks.decode_throughput import run_batch
from runtime.builtin_model import builtin_model_dir
from runtime.config import EngineConfig
from runtime.frontend.launch import open_engine


async def one_engine(args: argparse.Namespace, model: str, size: int) -> None:
    config = EngineConfig(
        model=model,
        mode="process",
        max_num_seqs=max(args.batch),
        dtype=args.dtype,
        num_threads=1,
        tensor_parallel_size=size,
    )
    async with open_engine(config) as engine:
        await run_batch(engine, 4, args.prompt_len, 8)  # warm-up: first-call costs
        info = engine.server_info()  # what the actors run, read back from them
        for batch in args.batch:
            r = await run_batch(engine, batch, args.prompt_len, args.output_len)
            print(
                f"tp={info['tensor_parallel_size']} threads/rank={info['num_threads']} "
                f"dtype={info['dtype']} batch={batch:>3} step={r['step_ms']:6.2f} ms "
                f"(forward {r['forward']:5.2f}; collectives {r['communicate']:5.2f}) "
                f"tok/s={r['tokens_per_s']:>6.0f}",
                flush=True,
            )


async def main_async(args: argparse.Namespace) -> None:
    model = args.model or str(builtin_model_dir())
    print(
        f"model={model} cores={len(os.sched_getaffinity(0))} prompt_len={args.prompt_len} "
        f"output_len={args.output_len}"
    )
    for _ in range(args.rounds):
        for size in args.sizes:
            await one_engine(args, model, size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint directory (default: the built-in model)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )
    trio.run(main_async, parser.parse_args())


if __name__ == "__main__":
    main()
