"""Does a flood of huge prompts stall everyone else? Latency of others, and API memory.

    python -m benchmarks.large_prompts [--model DIR] [--prompt-mb 10] [--count 20] [--checkout DIR]

Against `runtime serve`: one stream generates tokens and a pinger calls `/health` every 20 ms
while `--count` prompts of `--prompt-mb` MB each arrive (`/v1/completions`, `/v1/chat/
completions` and `/tokenize` in turn, two at a time). Prints the p50/p99/max of the health
latency and of the stream's inter-token gaps, during the flood and in a quiet run before it,
how each huge request was answered, and the API process's RSS before, after and at its peak.
`--checkout` serves an older checkout of the repository instead, to compare.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import trio

from benchmarks.servers import ours, process_tree
from runtime.checkpoints.builtin import builtin_model_dir


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def percentiles(values: list[float]) -> str:
    if not values:
        return "n/a"
    ordered = sorted(values)
    pick = [ordered[min(len(ordered) - 1, int(q * len(ordered)))] for q in (0.5, 0.99)]
    return f"p50 {1000 * pick[0]:6.1f}  p99 {1000 * pick[1]:6.1f}  max {1000 * ordered[-1]:6.1f} ms"


async def ping_health(http: httpx.AsyncClient, latencies: list[float], done: trio.Event) -> None:
    while not done.is_set():
        start = time.perf_counter()
        await http.get("/health")
        latencies.append(time.perf_counter() - start)
        await trio.sleep(0.02)


async def stream_tokens(http: httpx.AsyncClient, gaps: list[float], done: trio.Event) -> None:
    body = {"model": "m", "prompt": "x", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    last = None
    async with http.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
            if done.is_set():
                return


def huge_request(kind: str, megabytes: float) -> tuple[str, bytes]:
    text = "All work and no play makes Jack a dull boy. " * int(megabytes * 2**20 / 44)
    if kind == "chat":
        body = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 4}
        return "/v1/chat/completions", json.dumps(body).encode()
    if kind == "tokenize":
        return "/tokenize", json.dumps({"prompt": text}).encode()
    return "/v1/completions", json.dumps({"model": "m", "prompt": text, "max_tokens": 4}).encode()


def flood(url: str, bodies: list[tuple[str, bytes]], answers: dict[str, int]) -> None:
    """Send the prepared bodies, two at a time, from threads: this process's event loop, which
    times the others, must not stall on them itself."""

    def send(path: str, body: bytes) -> None:
        with httpx.Client(base_url=url, timeout=120) as http:
            response = http.post(path, content=body, headers={"Content-Type": "application/json"})
        key = f"{path} {response.status_code}"
        answers[key] = answers.get(key, 0) + 1

    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(lambda item: send(*item), bodies))


async def measure(url: str, bodies: list[tuple[str, bytes]] | None) -> dict:
    health: list[float] = []
    gaps: list[float] = []
    answers: dict[str, int] = {}
    done = trio.Event()
    async with (
        httpx.AsyncClient(base_url=url, timeout=120) as http,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(ping_health, http, health, done)
        nursery.start_soon(stream_tokens, http, gaps, done)
        await trio.sleep(0.5)  # the stream is running
        if bodies is not None:
            await trio.to_thread.run_sync(flood, url, bodies, answers)
        else:
            await trio.sleep(3.0)
        done.set()
    return {"health": health, "gaps": gaps, "answers": answers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint directory (default: the built-in model)")
    parser.add_argument("--prompt-mb", type=float, default=10.0)
    parser.add_argument("--count", type=int, default=20)
    parser.add_argument("--checkout", help="serve this checkout of the repository instead")
    args = parser.parse_args()
    model = args.model or str(builtin_model_dir())
    with ours(model, "auto", "m", checkout=args.checkout) as server:
        api = server.process.pid
        assert len(process_tree(api)) >= 3, "expected the API process and two actors"
        baseline = rss_mb(api)
        peak = [baseline]

        async def watch_memory(done: trio.Event) -> None:
            while not done.is_set():
                peak[0] = max(peak[0], rss_mb(api))
                await trio.sleep(0.05)

        kinds = ["completion", "chat", "tokenize"]
        bodies = [huge_request(kinds[i % 3], args.prompt_mb) for i in range(args.count)]

        async def run() -> tuple[dict, dict]:
            quiet = await measure(server.url, None)
            done = trio.Event()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch_memory, done)
                loud = await measure(server.url, bodies)
                done.set()
            return quiet, loud

        quiet, loud = trio.run(run)
        time.sleep(2.0)  # let the allocator hand memory back
        after = rss_mb(api)
    print(f"model={model} checkout={args.checkout or 'this'} {args.count} prompts of "
          f"{args.prompt_mb} MB, two at a time")  # fmt: skip
    for name, result in (("quiet", quiet), ("flood", loud)):
        print(f"{name:>6} /health   {percentiles(result['health'])}")
        print(f"{name:>6} ITL       {percentiles(result['gaps'])}")
    print(f"answers: {loud['answers']}")
    print(
        f"API RSS: {baseline:.0f} MB before, {peak[0]:.0f} MB peak, {after:.0f} MB after "
        f"({100 * (after - baseline) / baseline:+.0f}%)"
    )


if __name__ == "__main__":
    main()
