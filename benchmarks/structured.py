"""What a JSON-schema constraint costs: the ITL of one chat workload with and without it.

    python -m benchmarks.structured [--concurrency 1 8 32] [--repeats 3] [--output-len 64]
        [SERVE_ARGS...]

Starts `runtime serve` (the default model, SmolLM2, unless SERVE_ARGS name another) and, at
each concurrency, runs the same streamed chat requests (each prompt asks for a shop's
inventory as JSON) twice per repeat, the two arms interleaved and their order alternated,
after one uncounted round of both: once constrained by a strict JSON schema (OpenAI's
response_format) whose shortest answer is longer than --output-len, so every request streams
exactly that many tokens, under the mask all along; and once free, ignoring EOS, for as many
tokens. Prints what the server ran (read back from /server_info), then per concurrency the
median over the repeats of the ITL's p50 and p90 and of the output tokens/s, both ways, the
constrained ITL's ratio to the free one, and the spread of every run's ITL p50.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import httpx
import trio

from benchmarks.servers import Server, free_port
from runtime.cli.latency import RequestRecord, latency_summary

ITEM = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "qty": {"type": "integer", "minimum": 0, "maximum": 1000},
        "price": {"type": "number", "minimum": 0},
        "tags": {"type": "array", "items": {"enum": ["new", "sale", "used"]}, "maxItems": 2},
    },
    "required": ["name", "qty", "price", "tags"],
}
# 40 items at least: no answer ends within the output length, so both arms stream as many
SCHEMA = {
    "type": "object",
    "properties": {
        "shop": {"type": "string", "maxLength": 30},
        "items": {"type": "array", "items": ITEM, "minItems": 40},
    },
    "required": ["shop", "items"],
}
SPEC = {"name": "inventory", "schema": SCHEMA, "strict": True}
FORMAT = {"type": "json_schema", "json_schema": SPEC}


def body(i: int, model: str, output_len: int, constrained: bool) -> dict[str, Any]:
    question = f"List the inventory of shop number {i} as JSON: name, quantity, price, tags."
    request = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return request | ({"response_format": FORMAT} if constrained else {})


async def one_request(http: httpx.AsyncClient, request: dict[str, Any]) -> RequestRecord:
    record = RequestRecord(start=time.perf_counter())
    async with http.stream("POST", "/v1/chat/completions", json=request) as response:
        if response.status_code != 200:
            record.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            return record
        async for line in response.aiter_lines():
            if '"usage":{' in line:
                record.output_tokens = json.loads(line[6:])["usage"]["completion_tokens"]
            elif '"content":"' in line and '"content":""' not in line:
                now = time.perf_counter()
                record.first_token = record.first_token or now
                record.chunk_times.append(now)
    record.end = time.perf_counter()
    if record.output_tokens != request["max_tokens"]:
        record.error = f"got {record.output_tokens} tokens, wanted {request['max_tokens']}"
    return record


async def run_arm(
    url: str, model: str, concurrency: int, count: int, output_len: int, constrained: bool
) -> dict[str, Any]:
    limiter = trio.CapacityLimiter(concurrency)
    records: list[RequestRecord] = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:

        async def run(i: int) -> None:
            async with limiter:
                records.append(await one_request(http, body(i, model, output_len, constrained)))

        started = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(count):
                nursery.start_soon(run, i)
        return latency_summary(records, time.perf_counter() - started)


def median(runs: list[dict[str, Any]], key: str, field: str | None = None) -> float:
    return statistics.median(r[key][field] if field else r[key] for r in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=64)
    args, serve_args = parser.parse_known_args()
    port = free_port()
    command = [sys.executable, "-m", "runtime.cli.main", "serve", "--port", str(port),
               "--log-level", "warning", *serve_args]  # fmt: skip
    with Server("structured", command, port) as server:
        info = httpx.get(server.url + "/server_info").json()
        model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        print(
            f"{model}: dtype {info['dtype']}, {info['attention_backend']} kernels, "
            f"{info['num_threads']} threads, backend {info['structured_outputs_backend']}, "
            f"{args.output_len} tokens per request, {args.repeats} interleaved repeats"
        )
        runs: dict[tuple[int, bool], list[dict[str, Any]]] = {}
        # repeat -1 warms up, uncounted: the schema compiles, both processes build their
        # llguidance tokenizer, and the kernels meet each batch size (the first runs measured
        # up to 1.6x slower than later ones, either way)
        for repeat in range(-1, args.repeats):
            for c in args.concurrency:
                for constrained in (True, False) if repeat % 2 else (False, True):
                    count = max(4, 2 * c)
                    summary = trio.run(
                        run_arm, server.url, model, c, count, args.output_len, constrained
                    )
                    assert summary["errors"] == 0, summary["error_samples"]
                    if repeat >= 0:
                        runs.setdefault((c, constrained), []).append(summary)
    for c in args.concurrency:
        on, off = runs[(c, True)], runs[(c, False)]
        itl_on, itl_off = median(on, "itl_ms", "p50"), median(off, "itl_ms", "p50")
        spread = sorted(round(r["itl_ms"]["p50"], 1) for r in on + off)
        print(
            f"c{c}: ITL p50/p90 {itl_on:.1f}/{median(on, 'itl_ms', 'p90'):.1f} ms constrained, "
            f"{itl_off:.1f}/{median(off, 'itl_ms', 'p90'):.1f} ms free (x{itl_on / itl_off:.2f}); "
            f"{median(on, 'output_throughput'):.0f} vs {median(off, 'output_throughput'):.0f} "
            f"output tok/s; every run's ITL p50 {spread[0]}-{spread[-1]} ms"
        )


if __name__ == "__main__":
    main()
