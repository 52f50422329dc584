"""Quantized weights on a real model: `--quantization gguf` against the dequantized float32 model.

    python -m benchmarks.quantized [--model FILE.gguf] [--output-len 64] [--isa native avx2]

On the default model (SmolLM2-135M-Instruct, Q4_1 with a Q8_0 embedding) unless `--model`
says otherwise:

1. Greedy output on a few text prompts, the file's blocks multiplied by the kernels against
   the same file dequantized to float32: whether each continuation is the same, where it
   first differs, and at each step where the quantized model's token is not float32's best,
   how far below that best float32 scores it (in nats; a gap near 0 is a near tie).
2. Decode tok/s at concurrency 1 (`mode="process"`, as `runtime serve` runs), float32 and
   gguf with each `--isa` (RUNTIME_KERNEL_ISA: "avx2" builds the AVX2 kernels on an AVX-512
   CPU), with the bytes of weights a step reads and the tok/s that reading them at the
   measured copy bandwidth would allow.
"""

from __future__ import annotations

import argparse
import os
import platform
from pathlib import Path

import torch
import trio
from transformers import AutoTokenizer

from benchmarks.decode_throughput import run_batch
from benchmarks.where_time_goes import machine_limits
from runtime.checkpoints.default_model import default_model_file
from runtime.checkpoints.gguf import resolve_checkpoint
from runtime.config.engine import EngineConfig
from runtime.config.sampling import SamplingParams
from runtime.frontend.launch import open_engine
from runtime.protocol import PromptLogprob

PROMPTS = [
    "The capital of France is",
    "Write a Python function that reverses a string.\n\ndef reverse(s):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "Q: What is 17 times 23?\nA:",
    "Photosynthesis is the process by which",
    "Here is a list of five fruits:\n1.",
    "The most important thing to remember when learning a new language is",
]


async def greedy(config: EngineConfig, prompts: list[list[int]], length: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=length, temperature=0.0)
    outputs = []
    async with open_engine(config) as engine:
        for prompt in prompts:
            outputs.append(
                [t async for out in engine.generate(prompt, params) for t in out.token_ids]
            )
    return outputs


async def gaps_under_float32(
    config: EngineConfig, prompts: list[list[int]], outputs: list[list[int]]
) -> list[list[float]]:
    """For each generated token: how far below float32's best token float32 scores it."""
    gaps = []
    async with open_engine(config) as engine:
        for prompt, tokens in zip(prompts, outputs, strict=True):
            params = SamplingParams(
                max_tokens=1, prompt_logprobs=1, prompt_logprobs_start=len(prompt)
            )
            async for out in engine.generate(prompt + tokens, params):
                if out.prompt_logprobs:
                    gaps.append([gap(entry) for entry in out.prompt_logprobs])
    return gaps


def gap(entry: PromptLogprob) -> float:
    assert entry.top is not None and entry.logprob is not None  # every position past the first
    return max(logprob for _, logprob in entry.top) - entry.logprob


async def compare_outputs(args: argparse.Namespace, blocks: EngineConfig) -> None:
    floats = EngineConfig(model=args.model, mode="inproc", dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(resolve_checkpoint(args.model))
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    expected = await greedy(floats, prompts, args.output_len)
    got = await greedy(blocks, prompts, args.output_len)
    gaps = await gaps_under_float32(floats, prompts, got)
    same = sum(a == b for a, b in zip(got, expected, strict=True))
    print(f"\n1. greedy, {args.output_len} tokens: gguf blocks (kernels) vs dequantized float32")
    print(f"   the same tokens on {same} of {len(prompts)} prompts")
    print(f"   {'prompt':<40} {'first diff':>10} {'steps off best':>14} {'max gap':>8}")
    for text, a, b, g in zip(PROMPTS, got, expected, gaps, strict=True):
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        off = [x for x in g if x > 0]
        print(f"   {text[:40]!r:<40} {'-' if first is None else first:>10} "
              f"{len(off):>14} {max(off, default=0.0):>8.3f}")  # fmt: skip


async def decode_rate(config: EngineConfig, isa: str | None, bandwidth: float) -> str:
    saved = os.environ.get("RUNTIME_KERNEL_ISA")
    if isa:
        os.environ["RUNTIME_KERNEL_ISA"] = isa  # the worker process builds and loads those
    try:
        async with open_engine(config) as engine:
            await run_batch(engine, 1, 32, 16)  # warm
            runs = [await run_batch(engine, 1, 32, 128) for _ in range(3)]
            ready = engine.ready
            assert ready is not None
            worker = ready.worker
    finally:
        if saved is None:
            os.environ.pop("RUNTIME_KERNEL_ISA", None)
        else:
            os.environ["RUNTIME_KERNEL_ISA"] = saved
    rate = max(r["tokens_per_s"] for r in runs)
    step_ms = min(r["step_ms"] for r in runs)
    mb = worker.step_weight_bytes / 1e6
    limit = bandwidth / max(1, worker.step_weight_bytes)
    name = f"{worker.quantization}" + (f" [{isa}]" if isa else "")
    return (f"   {name[:44]:<44} {rate:>7.1f} {step_ms:>8.2f} {mb:>9.1f} {limit:>9.0f} "
            f"{rate / limit:>6.0%}")  # fmt: skip


async def main_async(args: argparse.Namespace) -> None:
    blocks = EngineConfig(model=args.model, mode="inproc", quantization="gguf")
    if not args.skip_outputs:
        await compare_outputs(args, blocks)
    common = {"model": args.model, "mode": "process", "max_num_seqs": 4,
              "num_threads": args.threads}  # fmt: skip
    probe = EngineConfig(**common, dtype="float32")
    threads = args.threads or torch.get_num_threads()
    _, bandwidth = machine_limits(threads)
    print(f"\n2. decode at concurrency 1 (32 tokens in, 128 out, best of 3); copy bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s with {threads} threads")  # fmt: skip
    print(f"   {'weights':<44} {'tok/s':>7} {'step ms':>8} {'MB/step':>9} {'limit':>9} "
          f"{'of it':>6}")  # fmt: skip
    print(await decode_rate(probe, None, bandwidth))
    gguf = EngineConfig(**common, quantization="gguf")
    for isa in args.isa:
        print(await decode_rate(gguf, None if isa == "native" else isa, bandwidth))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a .gguf file (default: SmolLM2-135M-Instruct Q4_1)")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--isa", nargs="+", default=["native", "avx2"], choices=["native", "avx2"])
    parser.add_argument("--skip-outputs", action="store_true", help="only the decode rates")
    args = parser.parse_args()
    args.model = args.model or str(default_model_file())
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    cpu = names[0] if names else platform.processor()
    print(f"model={Path(args.model).name} cpu={cpu} cores={os.cpu_count()}")
    trio.run(main_async, args)


if __name__ == "__main__":
    main()
