"""Soak: thousands of mixed, partly hostile requests; afterwards nothing may have leaked.

    python -m benchmarks.soak [--requests 10000] [--concurrency 32] [--max-seconds 900]

Against `runtime serve` (the tiny random model, float32, so greedy outputs do not depend on
the batch): first a quiet run records each prompt's greedy output; then `--requests`
requests, at most `--concurrency` at once, each drawn at random from: a good completion
(whole or streamed, its text must equal the quiet run's), a stream dropped after a few
chunks, bad input (bad JSON, a negative max_tokens, a prompt past the context, a lone
surrogate, a nested body), `/generate` reusing a request id while it runs (a 400) and right
after (served), a stalled reader that stops reading a stream for a while, a POST to an
unknown route on a reused connection (a 404, then the connection serves on), a connection
opened and left idle (the server must close it), and the red-team shapes of issue 28:
token-id bodies just under their route's limit (parsed) and over it (a 413, unparsed), a
chat of too many messages, a /detokenize of a context of ids, echo with log-probabilities
over many prompts (a large answer, sent in pieces), a streamed /generate with
log-probabilities, half a request left hanging, and bursts of silent sockets.

Meanwhile a prober in a process of its own (as a liveness probe is: the load generator's own
event loop must not add to its figures) asks GET /health every 100 ms on a connection of its
own. Prints requests
by kind and outcome, answers by status class (5xx must be 0), wrong answers, /health's
latency (p50, p99, max; the target is p99 under 100 ms), the RSS of each process, the API's
open file descriptors and the KV cache in use before and after, RSS along the way (a leak
grows with requests; a warm-up does not) and the API's RSS drift after the first tenth.

    python -m benchmarks.soak --requests 1000000000 --max-seconds 1800   # the 30-minute soak
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import re
import time
from collections import Counter
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event
from pathlib import Path

import httpx
import trio

from benchmarks.servers import ours, process_name, process_tree
from runtime.checkpoints.builtin import builtin_model_dir

PROMPTS = [f"Prompt number {i}: the {w} of" for i, w in enumerate(["tuple", "list", "dict", "set"])]
MAX_TOKENS = 12
BAD_BODIES: list[bytes] = [
    b"{not json",
    b'{"model": "m", "prompt": "x", "max_tokens": -1}',
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
        self.statuses: Counter[str] = Counter()  # answers by status class: "2xx", "4xx"...
        self.health: list[float] = []  # seconds each /health took (from the prober)
        self.context = 0  # the model's, in tokens (from /v1/models)

    async def count_status(self, response: httpx.Response) -> None:
        self.statuses[f"{response.status_code // 100}xx"] += 1

    async def one(self, http: httpx.AsyncClient, i: int) -> None:
        kind = self.rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
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
        await self.closed_by_server(await self.raw_connection(), "an idle connection")

    # -- the red-team shapes of issue 28 ----------------------------------------------------

    async def big_ids(self, http: httpx.AsyncClient, i: int) -> None:
        """Token ids just under the route's byte limit: parsed, then refused (the context)."""
        ids = [12345] * (BIG_BODY // 7)
        response = await http.post("/v1/completions", json={"model": "m", "prompt": ids})
        self.expect(response, (400,), "big ids")

    async def over_limit(self, http: httpx.AsyncClient, i: int) -> None:
        body = b'{"model": "m", "prompt": [' + b"1," * (2 * BIG_BODY) + b"1]}"
        headers = {"Content-Type": "application/json"}
        response = await http.post("/v1/completions", content=body, headers=headers)
        self.expect(response, (413,), "over the limit")

    async def many_messages(self, http: httpx.AsyncClient, i: int) -> None:
        messages = [{"role": "user", "content": "hi"}] * 2049
        body = {"model": "m", "messages": messages}
        response = await http.post("/v1/chat/completions", json=body)
        self.expect(response, (400,), "many messages")

    async def detokenize_many(self, http: httpx.AsyncClient, i: int) -> None:
        response = await http.post("/detokenize", json={"tokens": [7] * self.context})
        self.expect(response, (200,), "detokenize")

    async def echo_logprobs(self, http: httpx.AsyncClient, i: int) -> None:
        body = {"model": "m", "prompt": [[5] * 100] * 64, "echo": True, "logprobs": 5,
                "max_tokens": 1}  # fmt: skip
        response = await http.post("/v1/completions", json=body)
        self.expect(response, (200,), "echo with logprobs")

    async def generate_logprobs(self, http: httpx.AsyncClient, i: int) -> None:
        body = {"text": "x", "return_logprob": True, "stream": True,
                "sampling_params": {"max_new_tokens": 64, "ignore_eos": True}}  # fmt: skip
        async with http.stream("POST", "/generate", json=body) as response:
            events = [line async for line in response.aiter_lines() if line.startswith("data: {")]
        new = [len(json.loads(e[6:])["meta_info"]["output_token_logprobs"]) for e in events]
        if sum(new) != 64:  # each event carries only what is new
            self.wrong.append(f"streamed /generate logprobs: {sum(new)} != 64")

    async def half_request(self, http: httpx.AsyncClient, i: int) -> None:
        stream = await self.raw_connection()
        await stream.send_all(b"POST /v1/completions HTTP/1.1\r\nHost: soak\r\nContent-")
        await self.closed_by_server(stream, "half a request")

    async def silent_burst(self, http: httpx.AsyncClient, i: int) -> None:
        streams = [await self.raw_connection() for _ in range(50)]
        await trio.sleep(2.0)
        for stream in streams:
            await stream.aclose()

    async def raw_connection(self) -> trio.SocketStream:
        host, port = self.url.removeprefix("http://").split(":")
        return await trio.open_tcp_stream(host, int(port))

    async def closed_by_server(self, stream: trio.SocketStream, what: str) -> None:
        with trio.move_on_after(30):  # the server's keep-alive timeout is 5 s
            while await stream.receive_some(65536):
                pass
            await stream.aclose()
            return
        self.wrong.append(f"{what}: the connection was not closed")
        await stream.aclose()

    def expect(self, response: httpx.Response, statuses: tuple[int, ...], what: str) -> None:
        if response.status_code not in statuses:
            self.wrong.append(f"{what}: {response.status_code} {response.text[:120]}")


# Each request's kind, by weight.
KINDS = {
    "good": 30, "good_stream": 30, "drop": 15, "bad": 13, "rid_reuse": 8, "stall": 2,
    "unknown_route": 1, "idle": 1, "big_ids": 2, "over_limit": 2, "many_messages": 2,
    "detokenize_many": 2, "echo_logprobs": 2, "generate_logprobs": 3, "half_request": 1,
    "silent_burst": 1,
}  # fmt: skip
PROBE_INTERVAL = 0.1
BIG_BODY = 2**20 - 2**16  # just under the prompt routes' default limit (--max-body-mb 1)


async def soak(url: str, pid: int, args: argparse.Namespace, expected: dict[str, str]) -> Soak:
    run = Soak(url, expected, seed=0)
    async with httpx.AsyncClient(base_url=url) as http:
        run.context = (await http.get("/v1/models")).json()["data"][0]["max_model_len"]
    every = max(1, args.requests // 10)
    limiter = trio.CapacityLimiter(args.concurrency)
    trail_every = args.max_seconds / 10
    next_trail = time.monotonic()
    with trio.move_on_after(args.max_seconds):
        async with (
            httpx.AsyncClient(
                base_url=url, timeout=120, limits=httpx.Limits(max_connections=None),
                event_hooks={"response": [run.count_status]},
            ) as http,
            trio.open_nursery() as nursery,
        ):  # fmt: skip
            for i in range(args.requests):
                if i % every == 0 or time.monotonic() >= next_trail:
                    run.trail.append((i, rss_by_process(pid)))
                    next_trail = time.monotonic() + trail_every
                await limiter.acquire_on_behalf_of(i)
                nursery.start_soon(release_after, limiter, i, run.one, http, i)
    return run


def probe_health(url: str, stop: Event, results: Connection) -> None:
    """GET /health every PROBE_INTERVAL on a connection of its own, timed; in a process of
    its own, so the load generator's loop never delays a probe. Sends the seconds each took,
    and the status classes, when `stop` is set."""
    latencies: list[float] = []
    statuses: Counter[str] = Counter()
    with httpx.Client(base_url=url, timeout=30) as http:
        while not stop.wait(PROBE_INTERVAL):
            started = time.perf_counter()
            response = http.get("/health")
            latencies.append(time.perf_counter() - started)
            statuses[f"{response.status_code // 100}xx"] += 1
    results.send((latencies, dict(statuses)))


def soak_with_prober(
    url: str, pid: int, args: argparse.Namespace, expected: dict[str, str]
) -> Soak:
    context = multiprocessing.get_context("spawn")
    stop, (receive, send) = context.Event(), context.Pipe(duplex=False)
    prober = context.Process(target=probe_health, args=(url, stop, send), daemon=True)
    prober.start()
    try:
        run = trio.run(soak, url, pid, args, expected)
    finally:
        stop.set()
    run.health, statuses = receive.recv()
    prober.join()
    run.statuses.update(statuses)
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
        run = soak_with_prober(server.url, pid, args, expected)
        elapsed = time.monotonic() - started
        time.sleep(3.0)  # let aborted requests and closed sockets settle
        after = snapshot(pid, server.url)
    print(f"model={model} dtype=float32 {sum(run.outcomes.values())} requests in {elapsed:.0f} s")
    for key, count in sorted(run.outcomes.items()):
        print(f"  {key:32} {count}")
    print("answers by status:", dict(sorted(run.statuses.items())))
    print(f"wrong answers: {len(run.wrong)}", *run.wrong[:5], sep="\n  ")
    health = sorted(run.health)
    if health:
        p50, p99 = (health[int(q * (len(health) - 1))] * 1000 for q in (0.5, 0.99))
        print(f"/health: {len(health)} probes, p50 {p50:.1f} ms, p99 {p99:.1f} ms, "
              f"max {health[-1] * 1000:.1f} ms")  # fmt: skip
    print(f"{'':24} {'before':>10} {'after':>10}")
    for key in before:
        print(f"{key:24} {before[key]:>10.2f} {after.get(key, float('nan')):>10.2f}")
    names = list(run.trail[0][1]) if run.trail else []
    print("RSS (MB) as requests start:", *(f"{n.removeprefix('rss_'):>16}" for n in names))
    for started, figures in run.trail:
        print(f"{started:>27}", *(f"{figures.get(n, float('nan')):>16.1f}" for n in names))
    api = "rss_api_mb"
    if api in names and len(run.trail) > 2:
        warm, last = run.trail[1][1][api], after[api]
        print(f"{api} drift after the first tenth: {100 * (last - warm) / warm:+.1f}%")


if __name__ == "__main__":
    main()
