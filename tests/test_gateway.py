"""Two `runtime serve` processes behind the `smg` gateway (a dev extra) on loopback, as the
README's multi-machine commands run them: it routes requests to both, with the API key, and
its load-aware policy reads our `/v1/loads` from both."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from benchmarks.servers import free_port
from tests.server_process import ServerProcess

KEY = "gateway-test-key"


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


def test_smg_routes_to_both_and_reads_their_loads(workers: list[ServerProcess]) -> None:
    port, metrics_port = free_port(), free_port()
    command = [sys.executable, "-m", "smg.launch_router", "--host", "127.0.0.1", "--port",
               str(port), "--worker-urls", *[w.url for w in workers], "--policy",
               "power_of_two", "--load-monitor-interval", "1", "--prometheus-port",
               str(metrics_port), "--api-key", KEY, "--log-level", "warn"]  # fmt: skip
    gateway = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {KEY}"}
    try:

        def loads() -> list[dict] | None:
            body = httpx.get(url + "/get_loads", headers=headers, timeout=5).json()
            found = [load for load in body.get("loads", []) if load.get("max_total_num_tokens")]
            return found if len(found) == 2 else None

        polled = wait_for(loads, "the gateway to poll both workers' /v1/loads")
        assert {load["worker"] for load in polled} == {w.url for w in workers}  # type: ignore[union-attr]
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4}
        for _ in range(6):
            response = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == 4
        unauthorized = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert unauthorized.status_code == 401
        served = [count_requests(w) for w in workers]
        assert sum(served) == 6
    finally:
        gateway.terminate()
        try:
            gateway.wait(timeout=10)
        except subprocess.TimeoutExpired:
            gateway.kill()
            gateway.wait()


def count_requests(worker: ServerProcess) -> int:
    text = httpx.get(worker.url + "/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith("runtime:e2e_request_latency_seconds_count"):
            return int(float(line.split()[-1]))
    return 0
