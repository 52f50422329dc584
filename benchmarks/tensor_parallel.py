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

import trio

from benchmarks.data_parallel import alternate_sizes, sizes_parser
from benchmarks.decode_throughput import run_batch
from runtime.config.engine import EngineConfig
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


def main() -> None:
    args = sizes_parser(__doc__, batch=[1, 8, 32], output_len=64).parse_args()
    trio.run(alternate_sizes, args, one_engine)


if __name__ == "__main__":
    main()
