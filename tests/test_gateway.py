"""Two `runtime serve` processes behind the `smg` gateway (a dev extra) on loopback, as the
README's multi-machine commands run them: it routes requests to both, with the API key; its
load-aware policy reads our `/v1/loads` from both; streams pass through; and when one backend
dies, the gateway routes around it."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from benchmarks.servers import free_port
from tests.server_process import ServerProcess

KEY = "gateway-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY = {"model": "tiny", "prompt": "Hello", "max_tokens": 4}


@pytest.fixture
def workers(llama_dir: Path, tmp_path: Path) -> Iterator[list[ServerProcess]]:
    key_file = tmp_path / "key"
    key_file.write_text(KEY)
    servers = [ServerProcess(llama_dir, "--api-key-file", str(key_file)) for _ in range(2)]
    yield servers
    for server in servers:
        server.terminate()


def wait_for(check: object, what: str, timeout: float = 60) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = check()  # type: ignore[operator]
        except httpx.HTTPError:
            value = None
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@contextmanager
def gateway(workers: list[ServerProcess], policy: str, *options: str) -> Iterator[str]:
    """`smg launch`'s router in front of `workers`; yields its URL once it serves."""
    port, metrics_port = free_port(), free_port()
    command = [sys.executable, "-m", "smg.launch_router", "--host", "127.0.0.1", "--port",
               str(port), "--worker-urls", *[w.url for w in workers], "--policy", policy,
               "--prometheus-port", str(metrics_port), "--api-key", KEY, "--log-level", "warn",
               *options]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: httpx.get(url + "/health", timeout=5).status_code == 200, "the gateway")
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_smg_routes_to_both_and_reads_their_loads(workers: list[ServerProcess]) -> None:
    with gateway(workers, "power_of_two", "--load-monitor-interval", "1") as url:

        def loads() -> list[dict] | None:
            body = httpx.get(url + "/get_loads", headers=AUTH, timeout=5).json()
            found = [load for load in body.get("loads", []) if load.get("max_total_num_tokens")]
            return found if len(found) == 2 else None

        polled = wait_for(loads, "the gateway to poll both workers' /v1/loads")
        assert {load["worker"] for load in polled} == {w.url for w in workers}  # type: ignore[union-attr]
        for _ in range(6):
            response = httpx.post(url + "/v1/completions", json=BODY, headers=AUTH, timeout=60)
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == 4
        unauthorized = httpx.post(url + "/v1/completions", json=BODY, timeout=60)
        assert unauthorized.status_code == 401
        served = [count_requests(w) for w in workers]
        assert sum(served) == 6


def test_smg_streams_and_routes_around_a_dead_worker(workers: list[ServerProcess]) -> None:
    health = ["--health-check-interval-secs", "1", "--health-failure-threshold", "1",
              "--health-check-timeout-secs", "1"]  # fmt: skip
    with gateway(workers, "cache_aware", *health) as url:
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 5, "stream": True}  # fmt: skip
        with httpx.stream("POST", url + "/v1/chat/completions", json=chat, headers=AUTH) as r:
            assert r.status_code == 200
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and '"role":"assistant"' in events[0]
        for prompt in ("one", "two", "three", "four"):  # cache_aware spreads distinct prompts
            response = httpx.post(
                url + "/v1/completions", json=BODY | {"prompt": prompt}, headers=AUTH, timeout=60
            )
            assert response.status_code == 200
        dead, alive = workers
        before = count_requests(alive)
        dead.process.kill()  # SIGKILL: its actors exit with it
        dead.process.wait()
        killed = time.monotonic()

        def ten_in_a_row() -> bool:
            for i in range(10):
                body = BODY | {"prompt": f"after {i}"}
                response = httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=60)
                if response.status_code != 200:
                    return False
            return True

        wait_for(ten_in_a_row, "the gateway to route around the dead worker")
        print(f"routed around a dead worker {time.monotonic() - killed:.1f} s after it died")
        assert count_requests(alive) >= before + 10


def count_requests(worker: ServerProcess) -> int:
    text = httpx.get(worker.url + "/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith("runtime:e2e_request_latency_seconds_count"):
            return int(float(line.split()[-1]))
    return 0
