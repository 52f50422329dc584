"""The `smg` gateway in front of `runtime serve`: the latency it adds per request, and how long
a client sees errors after a backend dies.

    python -m benchmarks.gateway [--model DIR] [--requests 200] [--policy cache_aware]

Two servers (built-in model unless --model) and one gateway on loopback. Latency: the same
one-token completions, one at a time, sent to a server directly and through the gateway
(alternating, so the VM's drift hits both alike). Failover: one server is SIGKILLed, then
requests go through the gateway one at a time; it prints how many failed and when the last
failure was, for the health-check settings given (the README's: every second, one failure
marks a worker unhealthy).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time

import httpx

from benchmarks.servers import Server, free_port, ours
from runtime.checkpoints.builtin import builtin_model_dir

HEALTH = ["--health-check-interval-secs", "1", "--health-failure-threshold", "1",
          "--health-check-timeout-secs", "1"]  # fmt: skip


def gateway(workers: list[Server], policy: str, retries: int) -> Server:
    port = free_port()
    command = [sys.executable, "-m", "smg.launch_router", "--host", "127.0.0.1", "--port",
               str(port), "--worker-urls", *[w.url for w in workers], "--policy", policy,
               "--prometheus-port", str(free_port()), "--log-level", "warn",
               "--retry-max-retries", str(retries), *HEALTH]  # fmt: skip
    return Server("smg", command, port, startup_timeout=60)


def completion(http: httpx.Client, url: str, prompt: str) -> tuple[float, int]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    started = time.perf_counter()
    try:
        status = http.post(url + "/v1/completions", json=body).status_code
    except httpx.HTTPError:
        status = 0
    return time.perf_counter() - started, status


def latency(http: httpx.Client, direct: str, through: str, count: int) -> None:
    times: dict[str, list[float]] = {"direct": [], "gateway": []}
    for i in range(count):
        for name, url in (("direct", direct), ("gateway", through)):
            seconds, status = completion(http, url, f"request {i}")
            assert status == 200, f"{name}: HTTP {status}"
            times[name].append(1000 * seconds)
    for name, values in times.items():
        values.sort()
        p90 = values[int(0.9 * len(values))]
        print(f"{name:>8}: p50 {statistics.median(values):6.2f} ms   p90 {p90:6.2f} ms")
    added = statistics.median(times["gateway"]) - statistics.median(times["direct"])
    print(f"   added: {added:6.2f} ms per request (p50)")


def failover(http: httpx.Client, through: str, dead: Server, seconds: float) -> None:
    os.killpg(dead.process.pid, signal.SIGKILL)
    dead.process.wait()
    killed = time.perf_counter()
    failures: list[float] = []
    sent = 0
    while time.perf_counter() - killed < seconds:
        _, status = completion(http, through, f"after {sent}")
        sent += 1
        if status != 200:
            failures.append(time.perf_counter() - killed)
    last = f"the last {failures[-1]:.2f} s after the kill" if failures else "none"
    print(f"failover: {sent} requests in {seconds:.0f} s after a SIGKILL, ", end="")
    print(f"{len(failures)} failed ({last})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint directory (default: the built-in model)")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--policy", default="cache_aware")
    parser.add_argument("--failover-seconds", type=float, default=10.0)
    parser.add_argument(
        "--retries",
        type=int,
        default=5,
        help="the gateway's --retry-max-retries (its default: 5; 1 is none)",
    )
    args = parser.parse_args()
    model = args.model or str(builtin_model_dir())
    workers = [ours(model, "auto", "tiny", name=f"ours{i}") for i in range(2)]
    try:
        with (
            gateway(workers, args.policy, args.retries) as router,
            httpx.Client(timeout=60) as http,
        ):
            print(f"model={model} policy={args.policy} retries={args.retries} {' '.join(HEALTH)}")
            for _ in range(20):  # warm-up: connections, first-call costs
                completion(http, router.url, "warm")
                completion(http, workers[0].url, "warm")
            latency(http, workers[0].url, router.url, args.requests)
            failover(http, router.url, workers[1], args.failover_seconds)
    finally:
        for worker in workers:
            worker.stop()


if __name__ == "__main__":
    main()
