"""Embeddings per second from `runtime serve`'s /v1/embeddings, at several concurrencies.

    python -m benchmarks.embeddings [--model PATH] [--concurrency 1 8] [--seconds 20]

One server (the default model, SmolLM2-135M-Instruct, unless --model) in process mode. For
each concurrency C, C clients each send one request after another for `--seconds`, each with
`--batch` texts of about `--words` words (different texts every time, so the prefix cache
serves nothing), asking for base64 as the official client does. It prints what the engine
ran, read back from /get_server_info (dtype, torch threads, attention backend, pooling), then
per concurrency: embeddings/s, requests/s, prompt tokens/s and request latency p50/p99.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import httpx
import trio

from benchmarks.servers import ours

WORDS = [
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by",
    "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an",
    "they", "you", "were", "her", "she", "there", "one", "all", "we", "their", "can", "has",
    "been", "if", "more", "when", "will", "would", "who", "so", "no", "time", "list", "tuple",
    "dict", "object", "value", "sequence", "model", "token", "server", "request",
]  # fmt: skip


def texts(rng: random.Random, count: int, words: int) -> list[str]:
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(count)]


async def client(
    http: httpx.AsyncClient, args: argparse.Namespace, seed: int, until: float, out: dict
) -> None:
    rng = random.Random(seed)
    while time.monotonic() < until:
        body = {"model": "bench", "input": texts(rng, args.batch, args.words)}
        started = time.monotonic()
        response = await http.post("/v1/embeddings", json=body | {"encoding_format": "base64"})
        response.raise_for_status()
        out["latencies"].append(time.monotonic() - started)
        out["embeddings"] += len(response.json()["data"])
        out["tokens"] += response.json()["usage"]["prompt_tokens"]


async def measure(url: str, args: argparse.Namespace, concurrency: int) -> dict:
    out: dict = {"latencies": [], "embeddings": 0, "tokens": 0}
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        warm = {"latencies": [], "embeddings": 0, "tokens": 0}
        await client(http, args, -1, time.monotonic() + 1, warm)  # first-call costs
        started = time.monotonic()
        until = started + args.seconds
        async with trio.open_nursery() as nursery:
            for i in range(concurrency):
                nursery.start_soon(client, http, args, 1000 * concurrency + i, until, out)
        out["seconds"] = time.monotonic() - started
    return out


def report(concurrency: int, out: dict) -> str:
    seconds, latencies = out["seconds"], sorted(out["latencies"])
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    return (
        f"{concurrency:>4} {out['embeddings'] / seconds:>9.1f} {len(latencies) / seconds:>8.1f} "
        f"{out['tokens'] / seconds:>9.0f} {1000 * statistics.median(latencies):>9.1f} "
        f"{1000 * p99:>9.1f}"
    )


def main(args: argparse.Namespace) -> None:
    model = args.model
    if model is None:
        from runtime.checkpoints.default_model import default_model_file

        model = str(default_model_file())
    extra = ["--log-level", "warning", "--threads", str(args.threads)]
    with ours(model, args.dtype, "bench", extra) as server:
        info = httpx.get(server.url + "/get_server_info").json()  # what the engine runs
        print(
            f"model={info['model']} dtype={info['dtype']} threads={info['num_threads']} "
            f"attention={info['attention_backend']} pooling={info['pooling']} "
            f"max_num_batched_tokens={info['max_num_batched_tokens']} batch={args.batch} "
            f"words={args.words} startup={server.startup_seconds:.1f}s",
            flush=True,
        )
        print("conc  embeds/s   reqs/s  tokens/s   p50 ms    p99 ms", flush=True)
        for concurrency in args.concurrency:
            out = trio.run(measure, server.url, args, concurrency)
            print(report(concurrency, out), flush=True)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a checkpoint or .gguf (default: the default model)")
    parser.add_argument("--dtype", default="auto", help="the server's --dtype")
    parser.add_argument("--threads", type=int, default=0, help="the server's --threads")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--seconds", type=float, default=20.0, help="per concurrency")
    parser.add_argument("--batch", type=int, default=1, help="texts per request")
    parser.add_argument("--words", type=int, default=64, help="words per text")
    return parser.parse_args()


if __name__ == "__main__":
    main(parse_args())
