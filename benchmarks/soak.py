"""Soak: thousands of mixed, partly hostile requests; afterwards nothing may have leaked.

    python -m benchmarks.soak [--requests 10000] [--concurrency 32] [--max-seconds 900]

Against `runtime serve` (built-in model, float32, so greedy outputs do not depend on the batch):
first a quiet run records each prompt's greedy output; then `--requests` requests, at most
`--concurrency` at once, each drawn at random from: a good completion (whole or streamed, its
text must equal the quiet run's), a stream dropped after a few chunks, bad input (bad JSON, an
unknown field, a prompt past the context, a lone surrogate, a nested body), `/generate` reusing
a request id while it runs (a 400) and right after (served), a stalled reader that stops
reading a stream for a while, a POST to an unknown route on a reused connection (a 404, then
the connection serves on), and a connection opened and left idle (the server must close it).
Prints requests by kind and outcome, wrong answers, the RSS of each process, the API's open
file descriptors and the KV cache in use before and after, and RSS along the way (a leak
grows with requests; a warm-up does not).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import time
from collections import Counter
from pathlib import Path

import httpx
import trio

from benchmarks.servers import ours, process_name, process_tree
from runtime.checkpoints.builtin import builtin_model_dir

PROMPTS = [f"Prompt number {i}: the {w} of" for i, w in enumerate(["tuple", "list", "dict", "set"])]
MAX_TOKENS = 12
BAD_BODIES: list[bytes] = [
    b"{not json",
    b'{"model": "m", "prompt": "x", "bogus": 1}',
    b'{"model": "m", "prompt": "' + b"word " * 5000 + b'", "max_tokens": 4}',
    b'{"model": "m", "prompt": "\\ud800"}',
    b'{"model": "m", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
]


def snapshot(server_pid: int, url: str) -> dict[str, float]:
    """RSS by process (MB), the API's open fds, and what /metrics says is in use."""
    figures = rss_by_process(server_pid)
    figures["api_fds"] = len(os.listdir(f"/proc/{server_pid}/fd"))
    metrics = httpx.get(url + "/metrics").text
    for name in ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting"):
        samples = re.findall(rf"^runtime:{name}{{[^}}]*}} (\S+)$", metrics, re.MULTILINE)
        figures[name] = sum(map(float, samples)) if samples else -1.0  # over dp ranks
    return figures


def rss_by_process(server_pid: int) -> dict[str, float]:
    figures: dict[str, float] = {}
    for pid in process_tree(server_pid):
        name = process_name(pid)
        status = Path(f"/proc/{pid}/status").read_text()
        rss = int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024  # type: ignore[union-attr]
        figures[f"rss_{name}_mb"] = figures.get(f"rss_{name}_mb", 0.0) + rss
    return figures


async def completion(http: httpx.AsyncClient, prompt: str, stream: bool) -> str:
    body = {"model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    if not stream:
        response = await http.post("/v1/completions", json=body)
        response.raise_for_status()
        return str(response.json()["choices"][0]["text"])
    text = ""
    async with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


class Soak:
    def __init__(self, url: str, expected: dict[str, str], seed: int) -> None:
        self.url = url
        self.expected = expected
        self.rng = random.Random(seed)
        self.outcomes: Counter[str] = Counter()
        self.wrong: list[str] = []
        self.trail: list[tuple[int, dict[str, float]]] = []  # (requests started, RSS by process)

    async def one(self, http: httpx.AsyncClient, i: int) -> None:
        kind = self.rng.choices(
            ["good", "good_stream", "drop", "bad", "rid_reuse", "stall", "unknown_route", "idle"],
            weights=[30, 30, 15, 13, 8, 2, 1, 1],
        )[0]
        try:
            await getattr(self, kind)(http, i)
        except httpx.HTTPError as exc:
            self.outcomes[f"{kind}: {type(exc).__name__}"] += 1
            return
        self.outcomes[f"{kind}: ok"] += 1

    async def good(self, http: httpx.AsyncClient, i: int, stream: bool = False) -> None:
        prompt = PROMPTS[i % len(PROMPTS)]
        text = await completion(http, prompt, stream)
        if text != self.expected[prompt]:
            self.wrong.append(f"{prompt!r}: {text!r} != {self.expected[prompt]!r}")

    async def good_stream(self, http: httpx.AsyncClient, i: int) -> None:
        await self.good(http, i, stream=True)

    async def drop(self, http: httpx.AsyncClient, i: int) -> None:
        body = {"model": "m", "prompt": "x", "max_tokens": 200, "stream": True}
        keep = self.rng.randrange(0, 6)
        async with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.aiter_lines()  # held, so the stream closes when we leave
            async for _ in lines:
                keep -= 1
                if keep < 0:
                    break

    async def bad(self, http: httpx.AsyncClient, i: int) -> None:
        body = BAD_BODIES[i % len(BAD_BODIES)]
        headers = {"Content-Type": "application/json"}
        response = await http.post("/v1/completions", content=body, headers=headers)
        if not (400 <= response.status_code < 500 and "error" in response.json()):
            self.wrong.append(f"bad body {body[:40]!r}: {response.status_code}")

    async def rid_reuse(self, http: httpx.AsyncClient, i: int) -> None:
        rid = f"soak-{i % 7}"
        long = {"text": "x", "rid": rid, "sampling_params": {"max_new_tokens": 100}}
        async with http.stream("POST", "/generate", json=long | {"stream": True}) as response:
            lines = response.aiter_lines()
            async for _ in lines:
                break
            clash = await http.post("/generate", json=long)
            if clash.status_code not in (200, 400):  # 200 if another task's rid-mate ended
                self.wrong.append(f"rid clash: {clash.status_code}")
        again = await http.post("/generate", json=long | {"sampling_params": {"max_new_tokens": 2}})
        if again.status_code not in (200, 400):
            self.wrong.append(f"rid reuse: {again.status_code}")

    async def stall(self, http: httpx.AsyncClient, i: int) -> None:
        body = {"model": "m", "prompt": "x", "max_tokens": 300, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.aiter_lines()
            async for _ in lines:
                break
            await trio.sleep(2.0)  # not reading: the server's send backs up

    async def unknown_route(self, http: httpx.AsyncClient, i: int) -> None:
        response = await http.post("/v1/nowhere", json={"model": "m", "prompt": "x"})
        if response.status_code != 404 or "error" not in response.json():
            self.wrong.append(f"unknown route: {response.status_code}")

    async def idle(self, http: httpx.AsyncClient, i: int) -> None:
        host, port = self.url.removeprefix("http://").split(":")
        stream = await trio.open_tcp_stream(host, int(port))
        with trio.move_on_after(30):  # the server's keep-alive timeout is 5 s
            if await stream.receive_some(1) == b"":
                await stream.aclose()
                return
        self.wrong.append("an idle connection was not closed")
        await stream.aclose()


async def soak(url: str, pid: int, args: argparse.Namespace, expected: dict[str, str]) -> Soak:
    run = Soak(url, expected, seed=0)
    every = max(1, args.requests // 10)
    limiter = trio.CapacityLimiter(args.concurrency)
    with trio.move_on_after(args.max_seconds):
        async with (
            httpx.AsyncClient(
                base_url=url, timeout=120, limits=httpx.Limits(max_connections=None)
            ) as http,
            trio.open_nursery() as nursery,
        ):
            for i in range(args.requests):
                if i % every == 0:
                    run.trail.append((i, rss_by_process(pid)))
                await limiter.acquire_on_behalf_of(i)
                nursery.start_soon(release_after, limiter, i, run.one, http, i)
    return run


async def release_after(limiter: trio.CapacityLimiter, token: int, fn, *args) -> None:  # type: ignore[no-untyped-def]
    try:
        await fn(*args)
    finally:
        limiter.release_on_behalf_of(token)


async def quiet_run(url: str) -> dict[str, str]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        return {prompt: await completion(http, prompt, stream=False) for prompt in PROMPTS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint directory (default: the built-in model)")
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-seconds", type=float, default=900.0)
    parser.add_argument(
        "--kv-cache-memory", default="256MiB", help="the server's KV pool (small: more eviction)"
    )
    args = parser.parse_args()
    model = args.model or str(builtin_model_dir())
    with ours(model, "float32", "m", ["--kv-cache-memory", args.kv_cache_memory]) as server:
        pid = server.process.pid
        expected = trio.run(quiet_run, server.url)
        before = snapshot(pid, server.url)
        started = time.monotonic()
        run = trio.run(soak, server.url, pid, args, expected)
        elapsed = time.monotonic() - started
        time.sleep(3.0)  # let aborted requests and closed sockets settle
        after = snapshot(pid, server.url)
    print(f"model={model} dtype=float32 {sum(run.outcomes.values())} requests in {elapsed:.0f} s")
    for key, count in sorted(run.outcomes.items()):
        print(f"  {key:32} {count}")
    print(f"wrong answers: {len(run.wrong)}", *run.wrong[:5], sep="\n  ")
    print(f"{'':24} {'before':>10} {'after':>10}")
    for key in before:
        print(f"{key:24} {before[key]:>10.2f} {after.get(key, float('nan')):>10.2f}")
    names = list(run.trail[0][1]) if run.trail else []
    print("RSS (MB) as requests start:", *(f"{n.removeprefix('rss_'):>16}" for n in names))
    for started, figures in run.trail:
        print(f"{started:>27}", *(f"{figures.get(n, float('nan')):>16.1f}" for n in names))


if __name__ == "__main__":
    main()
