"""Data parallelism: output throughput with one scheduler+worker group against two.

    python -m benchmarks.data_parallel [--model DIR] [--batch 32 64] [--rounds 2]

For each round, and each of `--sizes` (default 1 then 2), an engine starts in process mode
with one torch thread per worker, and `run_batch` (benchmarks/decode_throughput.py) runs B
requests decoding `--output-len` tokens each: tokens per second while all of them decode.
Rounds alternate the sizes, so the machine's drift hits both alike. Each line prints what the
engine ran, read back from it, and how the tokens split over the groups.

On a machine with fewer free cores than workers, the groups share cores and the figure says
how much a second group costs rather than what it adds.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Awaitable, Callable

import trio

from benchmarks.decode_throughput import run_batch
from runtime.checkpoints.builtin import builtin_model_dir
from runtime.config.engine import EngineConfig
from runtime.frontend.launch import open_engine


async def one_engine(args: argparse.Namespace, model: str, size: int) -> None:
    config = EngineConfig(
        model=model,
        mode="process",
        max_num_seqs=max(args.batch),
        dtype=args.dtype,
        num_threads=1,
        data_parallel_size=size,
    )
    async with open_engine(config) as engine:
        await run_batch(engine, 4 * size, args.prompt_len, 8)  # warm-up: first-call costs
        info = engine.server_info()  # what the actors run, read back from them
        for batch in args.batch:
            before = [r.scheduler.num_generated_tokens for r in engine.statistics().per_rank()]
            result = await run_batch(engine, batch, args.prompt_len, args.output_len)
            after = [r.scheduler.num_generated_tokens for r in engine.statistics().per_rank()]
            split = "/".join(str(a - b) for a, b in zip(after, before, strict=True))
            print(
                f"dp={info['data_parallel_size']} threads/worker={info['num_threads']} "
                f"dtype={info['dtype']} batch={batch:>3} "
                f"tok/s={result['tokens_per_s']:>7.0f} tokens by group={split}",
                flush=True,
            )


OneEngine = Callable[[argparse.Namespace, str, int], Awaitable[None]]


async def alternate_sizes(args: argparse.Namespace, one_engine: OneEngine) -> None:
    """`one_engine(args, model, size)` for each of `args.sizes`, `args.rounds` times over."""
    model = args.model or str(builtin_model_dir())
    print(
        f"model={model} cores={len(os.sched_getaffinity(0))} prompt_len={args.prompt_len} "
        f"output_len={args.output_len}"
    )
    for _ in range(args.rounds):
        for size in args.sizes:
            await one_engine(args, model, size)


def sizes_parser(doc: str, batch: list[int], output_len: int) -> argparse.ArgumentParser:
    """The options of a benchmark that compares engine sizes (this one, tensor_parallel)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--model", help="checkpoint directory (default: the built-in model)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batch", type=int, nargs="+", default=batch)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=output_len)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )
    return parser


def main() -> None:
    args = sizes_parser(__doc__, batch=[32, 64], output_len=128).parse_args()
    trio.run(alternate_sizes, args, one_engine)


if __name__ == "__main__":
    main()
