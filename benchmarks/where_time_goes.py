"""Where a step's time goes on a real model, each part against its own limit.

    python -m benchmarks.where_time_goes [--model DIR|FILE.gguf] [--batch 1 8 32] [--dtype float32]
        [--quantization gguf] [--worker-only]

Two views, on the default model (SmolLM2-135M-Instruct) unless `--model` says otherwise:

1. The worker's step, in one process (`mode="inproc"`), each kind of work timed where it is
   called: the linears by shape (qkv, o, gate_up, down), attention, the final norm and the
   LM head (the vocabulary-wide logits), sampling, the small elementwise kernels (norms,
   rotary, SiLU), and what is left of the step (Python, input preparation). Decode at each
   `--batch` (through the model's Python layers, whose calls it can time; then the same steps
   as served, a pure decode step's layers in one call: runtime/layers/decode_layers.py), and
   a prefill of `--prefill` tokens. Each linear's time is set against its
   limit on this machine: reading its weights at the measured memory bandwidth (a STREAM-like
   copy) or its FLOPs at the measured GEMM rate (a large float32 GEMM, MKL's or oneDNN's,
   whichever is faster), whichever is longer.
2. The processes around it: `runtime serve` streaming `--batch` requests over HTTP, the CPU
   time each process (API, scheduler, worker) spends per generated token, read from /proc:
   the API's share is its per-token work (detokenizing, SSE framing, JSON), the scheduler's
   scheduling and messaging.

It prints what the engine ran (dtype, threads, read back from it), the machine's figures, and
one table per view. The timers wrap calls that return when the work is done (CPU kernels),
and add about a microsecond each.
"""

from __future__ import annotations

import argparse
import collections
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch
import trio

from runtime.checkpoints.default_model import default_model_file
from runtime.config.engine import EngineConfig
from runtime.config.sampling import SamplingParams
from runtime.frontend.launch import open_engine
from runtime.worker.huge_pages import huge_empty

# seconds by kind of work
SPENT: collections.defaultdict[str, float] = collections.defaultdict(float)
IDEAL: collections.Counter[str] = collections.Counter()  # seconds at the machine's limits
CALLS: collections.Counter[str] = collections.Counter()
LIMITS = [0.0, 0.0]  # float32 GEMM FLOP/s, memory bytes/s: measured before counting


def timed(kind: Callable[..., str], function: Callable[..., Any]) -> Callable[..., Any]:
    """`function`, timing each call under the kind `kind(*args)` names."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            name = kind(*args, **kwargs)
            SPENT[name] += time.perf_counter() - started
            CALLS[name] += 1

    return wrapper


def linear_kind(module: Any, x: torch.Tensor, *_: Any, **__: Any) -> str:
    """A linear by its weight's shape (the LM head by name); what it would take at the
    machine's limits: its weights read at the memory bandwidth, or its FLOPs at the GEMM
    rate, whichever is longer."""
    from runtime.layers.parallel import ParallelLMHead

    n, k = module.weight.shape[0], module.in_features  # a weight of blocks: [n, row bytes]
    name = f"{'lm head' if isinstance(module, ParallelLMHead) else 'linear'} {n}x{k}"
    flops, weight_bytes = (
        2.0 * x.shape[0] * n * k,
        module.weight.numel() * module.weight.element_size(),
    )
    if LIMITS[0]:
        IDEAL[name] += max(flops / LIMITS[0], weight_bytes / LIMITS[1])
    return name


@contextmanager
def instrumented() -> Iterator[None]:
    """Time the worker's kinds of work, where the model calls them."""
    from runtime.kernels.cpu import CpuKernels
    from runtime.layers import basic
    from runtime.models import llama
    from runtime.worker import model_runner

    def named(name: str) -> Callable[..., str]:
        return lambda *args, **kwargs: name

    small = "norms, rotary, silu"
    runner = model_runner.ModelRunner
    patches = [
        (basic.Linear, "product", timed(linear_kind, basic.Linear.product)),
        (llama, "paged_attention", timed(named("attention"), llama.paged_attention)),
        (CpuKernels, "rms_norm", timed(named(small), CpuKernels.rms_norm)),
        (CpuKernels, "rotary_", timed(named(small), CpuKernels.rotary_)),
        (CpuKernels, "silu_and_mul", timed(named(small), CpuKernels.silu_and_mul)),
        (model_runner, "sample", timed(named("sampling"), model_runner.sample)),
        (runner, "execute", timed(named("step"), runner.execute)),
    ]  # fmt: skip
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, wrapper in patches:
        setattr(owner, name, wrapper)
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


@contextmanager
def layer_by_layer() -> Iterator[None]:
    """Decode steps through the model's Python layers, whose kernels `instrumented` times
    (runtime/layers/decode_layers.py runs them in one call, out of its sight)."""
    from runtime.layers.decode_layers import DecodeLayers

    runs = DecodeLayers.runs
    DecodeLayers.runs = lambda self, x, meta: False  # type: ignore[method-assign]
    try:
        yield
    finally:
        DecodeLayers.runs = runs  # type: ignore[method-assign]


def machine_limits(threads: int) -> tuple[float, float]:
    """(float32 GEMM FLOP/s, memory bandwidth in bytes/s) with `threads` threads: the best of
    several runs each, as STREAM reports, and for the GEMM the faster of torch's `mm` (MKL)
    and oneDNN with the weight packed (what the engine runs for float32 prefills)."""
    torch.set_num_threads(threads)
    a = torch.randn(2048, 2048)
    b = torch.randn(2048, 2048)
    products = [lambda: torch.mm(a, b)]
    if torch.backends.mkldnn.is_available():
        packed = torch.ops.mkldnn._reorder_linear_weight(b, 2048)
        products.append(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""))
    flops = 2 * 2048**3 / min(best_time(product) for product in products)
    return flops, copy_rate(threads)


def copy_rate(threads: int) -> float:
    """Memory bandwidth in bytes/s with `threads` threads: a STREAM-like copy (read + write
    counted), the best of several, in 4 KB pages and in 2 MB ones (the served weights' and KV
    pool's: runtime/worker/huge_pages.py), whichever is faster (on the AMD EPYC VM 2 MB pages
    copied ~12% faster: 32 against 36 GB/s)."""
    torch.set_num_threads(threads)
    size = 256 * 2**20  # far past every cache
    plain = [torch.ones(size // 4), torch.empty(size // 4)]
    huge = [huge_empty(size).view(torch.float32).fill_(1.0), huge_empty(size).view(torch.float32)]
    return max(2 * size / best_time(partial(b.copy_, a)) for a, b in (plain, huge))


def best_time(fn: Callable[[], Any], runs: int = 6) -> float:
    """The shortest of `runs` timed calls, after one untimed."""
    fn()
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def in_own_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` in a thread that then ends, taking its OpenMP pool with it: a second pool
    that lives on makes libgomp put the worker's threads to sleep between kernels
    (runtime/worker/torch_thread.py), which would slow the engine under measurement."""
    results: list[Any] = []
    thread = threading.Thread(target=lambda: results.append(fn(*args)))
    thread.start()
    thread.join()
    return results[0]


async def decode_steps(engine: Any, batch: int, prompt_len: int, output_len: int) -> int:
    """`batch` greedy requests of `output_len` tokens; the steps it took."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    prompts = [[100 + (i * 7 + j) % 4000 for j in range(prompt_len)] for i in range(batch)]

    async def one(prompt: list[int]) -> None:
        async for _ in engine.generate(prompt, params):
            pass

    before = CALLS["step"]
    async with trio.open_nursery() as nursery:
        for prompt in prompts:
            nursery.start_soon(one, prompt)
    return CALLS["step"] - before


def table(title: str, steps: int) -> None:
    total = SPENT["step"]
    print(f"\n{title}: {steps} steps, {1000 * total / steps:.2f} ms a step")
    print(f"  {'work':<24} {'ms/step':>8} {'share':>6} {'% of limit':>11}")
    shown = 0.0
    for name, seconds in sorted(SPENT.items(), key=lambda item: -item[1]):
        if name == "step":
            continue
        shown += seconds
        limit = f"{100 * IDEAL[name] / seconds:>10.0f}%" if name in IDEAL else ""
        print(
            f"  {name:<24} {1000 * seconds / steps:>8.2f} "
            f"{100 * seconds / total:>5.0f}% {limit:>11}"
        )
    rest = total - shown
    print(
        f"  {'rest (python, inputs)':<24} {1000 * rest / steps:>8.2f} {100 * rest / total:>5.0f}%"
    )


async def worker_view(args: argparse.Namespace) -> None:
    config = EngineConfig(model=args.model, mode="inproc", dtype=args.dtype,
                          max_num_seqs=max(args.batch), num_threads=args.threads,
                          quantization=args.quantization)  # fmt: skip
    with instrumented():
        async with open_engine(config) as engine:
            await decode_steps(engine, 2, 8, 4)  # warm-up
            ran = engine.ready
            assert ran is not None
            threads = ran.worker.num_threads
            LIMITS[:] = limits = in_own_thread(machine_limits, threads)
            print(f"model={args.model} dtype={ran.worker.dtype} threads={threads} "
                  f"attention={ran.worker.attention_backend} "
                  f"quantization={ran.worker.quantization}")  # fmt: skip
            gemm, memory = limits[0] / 1e9, limits[1] / 1e9
            print(f"machine: float32 GEMM {gemm:.0f} GFLOP/s, memory {memory:.1f} GB/s "
                  f"(copy: read + write), {threads} threads")  # fmt: skip
            for batch in args.batch:
                SPENT.clear()
                IDEAL.clear()
                with layer_by_layer():
                    steps = await decode_steps(engine, batch, 16, args.output_len)
                table(f"decode, batch {batch}, layer by layer", steps)
                SPENT.clear()
                steps = await decode_steps(engine, batch, 16, args.output_len)
                print(f"  as served, a decode step's layers in one call where the kernels "
                      f"cover them: {1000 * SPENT['step'] / steps:.2f} ms a step")  # fmt: skip
            SPENT.clear()
            IDEAL.clear()
            steps = await decode_steps(engine, 1, args.prefill, 1)
            table(f"prefill of {args.prefill} tokens", steps)


def process_view(args: argparse.Namespace) -> None:
    """CPU seconds per generated token in each process of `runtime serve`."""
    import httpx

    from benchmarks.servers import ours, process_name, process_tree

    def cpu_by_process(pid: int) -> dict[str, float]:
        spent: collections.defaultdict[str, float] = collections.defaultdict(float)
        for child in process_tree(pid):
            stat = Path(f"/proc/{child}/stat").read_text()
            fields = stat.rsplit(")", 1)[1].split()
            spent[process_name(child)] += (int(fields[11]) + int(fields[12])) / os.sysconf(
                "SC_CLK_TCK"
            )
        return spent

    async def stream(url: str, batch: int) -> int:
        body = {"model": "m", "prompt": "Once upon a time", "max_tokens": args.output_len,
                "ignore_eos": True, "temperature": 0, "stream": True}  # fmt: skip
        tokens = 0

        async def one(http: httpx.AsyncClient) -> None:
            nonlocal tokens
            async with http.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    tokens += line.startswith("data: {")

        async with httpx.AsyncClient(base_url=url, timeout=600) as http, trio.open_nursery() as n:
            for _ in range(batch):
                n.start_soon(one, http)
        return tokens

    extra = ["--quantization", args.quantization] if args.quantization else []
    with ours(args.model, args.dtype, "m", extra) as server:
        info = httpx.get(server.url + "/get_server_info").json()
        print(f"\nruntime serve: dtype={info['dtype']} threads={info['num_threads']}")
        print(
            f"  {'batch':>5} {'tok/s':>7} | CPU ms per token: "
            f"{'api':>6} {'scheduler':>9} {'worker':>7}"
        )
        for batch in args.batch:
            trio.run(stream, server.url, 1)  # warm
            before = cpu_by_process(server.process.pid)
            started = time.perf_counter()
            tokens = trio.run(stream, server.url, batch)
            elapsed = time.perf_counter() - started
            after = cpu_by_process(server.process.pid)
            per = {k: 1000 * (after[k] - before.get(k, 0.0)) / tokens for k in after}
            print(f"  {batch:>5} {tokens / elapsed:>7.0f} | {'':17} {per.get('api', 0):>6.2f} "
                  f"{per.get('scheduler', 0):>9.2f} {per.get('worker', 0):>7.2f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--quantization", choices=["gguf", "int8"])
    parser.add_argument("--worker-only", action="store_true", help="no runtime serve view")
    args = parser.parse_args()
    args.model = args.model or str(default_model_file())
    trio.run(worker_view, args)
    if not args.worker_only:
        process_view(args)


if __name__ == "__main__":
    main()
