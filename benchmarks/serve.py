"""Load generator for any OpenAI-compatible server (ours, vLLM, SGLang...).

    python -m benchmarks.serve --url http://127.0.0.1:8000 --model tiny-llama \
        --input-len 128 --output-len 128 --concurrency 8 --num-prompts 64 --out result.json

Prompts are random token ids (so the input length is exact) sent to `/v1/completions` with
`ignore_eos` (so the output length is exact), streamed. Either a fixed number of requests in
flight (`--concurrency`) or Poisson arrivals (`--request-rate`, optionally capped by
`--concurrency`). Warm-up requests run first and are not counted. Prints TTFT, ITL (gap between
streamed chunks), TPOT ((end - first token) / (tokens - 1)) and end-to-end latency
percentiles, request and output-token throughput, and errors; writes them as JSON.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import re
import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx
import trio

from runtime.cli.latency import RequestRecord, latency_summary, print_latency


@dataclass(frozen=True, kw_only=True)
class Workload:
    url: str
    model: str
    input_len: int = 128
    output_len: int = 128
    num_prompts: int = 64
    concurrency: int | None = 8
    request_rate: float | None = None
    warmup: int = 4
    vocab_size: int = 4000
    seed: int = 0
    # prompts as text, decoded by this checkpoint's tokenizer (for servers that take no ids,
    # such as llama-cpp-python's): each system re-tokenizes the same text
    tokenizer: str | None = None
    api_key: str | None = None


def make_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab_size) for _ in range(length)] for _ in range(count)]


# a streamed chunk with text, and the usage chunk, as any server spaces its JSON
TEXT_CHUNK = re.compile(r'"text": ?"(?!")')
USAGE_CHUNK = re.compile(r'"usage": ?\{')


@functools.cache
def _tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def as_text(prompts: list[list[int]], tokenizer: str) -> list[str]:
    return [_tokenizer(tokenizer).decode(prompt) for prompt in prompts]


async def one_request(
    http: httpx.AsyncClient, w: Workload, prompt: list[int] | str
) -> RequestRecord:
    body = {
        "model": w.model,
        "prompt": prompt,
        "max_tokens": w.output_len,
        "min_tokens": w.output_len,  # where ignore_eos is not known (llama-cpp-python)
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    record = RequestRecord(start=time.perf_counter())
    try:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return record
            async for line in response.aiter_lines():
                # Parse as little as possible: this process shares the machine with the server.
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if USAGE_CHUNK.search(line):
                    record.output_tokens = json.loads(line[6:])["usage"]["completion_tokens"]
                elif TEXT_CHUNK.search(line):
                    now = time.perf_counter()
                    record.first_token = record.first_token or now
                    record.chunk_times.append(now)
    except (httpx.HTTPError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    record.end = time.perf_counter()
    if not record.output_tokens:  # a server that sends no usage: one token per chunk
        record.output_tokens = len(record.chunk_times)
    if record.error is None and record.output_tokens != w.output_len:
        record.error = f"got {record.output_tokens} tokens, wanted {w.output_len}"
    return record


async def run_requests(
    http: httpx.AsyncClient,
    w: Workload,
    prompts: list[list[int]] | list[str],
    rate: float | None,
    limit: int | None,
) -> list[RequestRecord]:
    records: list[RequestRecord] = []
    limiter = trio.CapacityLimiter(limit or len(prompts) or 1)
    rng = random.Random(w.seed + 1)

    async def run(prompt: list[int] | str) -> None:
        async with limiter:
            records.append(await one_request(http, w, prompt))

    async with trio.open_nursery() as nursery:
        for prompt in prompts:
            nursery.start_soon(run, prompt)
            if rate:
                await trio.sleep(rng.expovariate(rate))
    return records


async def benchmark(w: Workload) -> dict[str, Any]:
    """Run the workload; returns the summary (and the raw records)."""
    prompts: list[list[int]] | list[str]
    prompts = make_prompts(w.warmup + w.num_prompts, w.input_len, w.vocab_size, w.seed)
    if w.tokenizer is not None:
        prompts = as_text(prompts, w.tokenizer)
    headers = {"Authorization": f"Bearer {w.api_key}"} if w.api_key else {}
    connections = max(w.concurrency or 0, 64) + w.warmup
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    async with httpx.AsyncClient(
        base_url=w.url, headers=headers, timeout=600, limits=limits
    ) as http:
        if w.warmup:
            await run_requests(http, w, prompts[: w.warmup], None, w.concurrency)
        started = time.perf_counter()
        records = await run_requests(http, w, prompts[w.warmup :], w.request_rate, w.concurrency)
        duration = time.perf_counter() - started
    return summarize(w, records, duration)


def summarize(w: Workload, records: list[RequestRecord], duration: float) -> dict[str, Any]:
    return {"workload": asdict(w) | {"api_key": None}, **latency_summary(records, duration)}


def print_summary(s: dict[str, Any]) -> None:
    w = s["workload"]
    print(
        f"{w['url']} model={w['model']} in={w['input_len']} out={w['output_len']} "
        f"concurrency={w['concurrency']} rate={w['request_rate']} prompts={w['num_prompts']}"
    )
    print_latency(s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=None)
    parser.add_argument("--request-rate", type=float, default=None, help="Poisson, requests/s")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--api-key")
    parser.add_argument("--out", help="write the summary as JSON here")
    args = parser.parse_args()
    if args.concurrency is None and args.request_rate is None:
        args.concurrency = 8
    workload = Workload(
        url=args.url,
        model=args.model,
        input_len=args.input_len,
        output_len=args.output_len,
        num_prompts=args.num_prompts,
        concurrency=args.concurrency,
        request_rate=args.request_rate,
        warmup=args.warmup,
        vocab_size=args.vocab_size,
        seed=args.seed,
        api_key=args.api_key,
    )
    summary = trio.run(benchmark, workload)
    print_summary(summary)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
