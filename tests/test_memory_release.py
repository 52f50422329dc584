"""release_memory_occupation / resume_memory_occupation on a real server: the worker's memory
really goes back to the system, requests wait meanwhile, and the weights come back whole."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from api.client import Client
from tests.server_process import ServerProcess

BODY = {
    "input_ids": list(range(3, 23)),
    "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
}
KV_MIB = 64


@pytest.fixture(scope="module")
def server(llama_dir: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        llama_dir,
        *("--dtype", "float32", "--enable-control-api", "--kv-cache-memory", f"{KV_MIB}MiB"),
    )
    yield proc
    proc.terminate()


def worker_rss_mib(server: ServerProcess) -> float:
    for pid in server.child_pids():
        if Path(f"/proc/{pid}/cmdline").read_text().split("\0")[3] == "worker":
            status = Path(f"/proc/{pid}/status").read_text()
            return int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024  # type: ignore[union-attr]
    raise AssertionError("no worker process")


def generate(server: ServerProcess, body: dict = BODY) -> list[int]:
    response = httpx.post(server.url + "/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return list(response.json()["output_ids"])


def post(server: ServerProcess, path: str, **kwargs: object) -> httpx.Response:
    return httpx.post(server.url + path, timeout=120, **kwargs)  # type: ignore[arg-type]


def test_release_returns_memory_and_resume_brings_back_the_same_model(
    server: ServerProcess,
) -> None:
    expected = generate(server)
    before = worker_rss_mib(server)
    assert post(server, "/release_memory_occupation").json()["success"] is True
    released = worker_rss_mib(server)
    assert before - released > KV_MIB * 0.8  # the KV pool, at least, left the process
    assert httpx.get(server.url + "/is_sleeping").json() == {"is_sleeping": True}

    result: list[list[int]] = []
    waiting = threading.Thread(target=lambda: result.append(generate(server)))
    waiting.start()
    time.sleep(1.0)
    assert not result  # held until the memory is back
    refused = post(server, "/continue_generation")
    assert refused.status_code == 400
    assert "resume_memory_occupation first" in refused.json()["error"]["message"]

    assert post(server, "/resume_memory_occupation").json()["success"] is True
    waiting.join(timeout=60)
    assert result == [expected]  # the weights, reloaded from disk, are the same
    assert worker_rss_mib(server) - released > KV_MIB * 0.8
    assert httpx.get(server.url + "/is_sleeping").json() == {"is_sleeping": False}
    assert httpx.get(server.url + "/is_paused").json() == {"is_paused": False}


def test_release_is_refused_while_a_request_runs(server: ServerProcess) -> None:
    body = BODY | {"sampling_params": BODY["sampling_params"] | {"max_new_tokens": 1500}}
    result: list[list[int]] = []
    running = threading.Thread(target=lambda: result.append(generate(server, body)))
    running.start()
    deadline = time.monotonic() + 60
    running_one = 'runtime:num_requests_running{dp_rank="0"} 1.0'
    while running_one not in httpx.get(server.url + "/metrics").text:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    refused = post(server, "/release_memory_occupation", json={"tags": ["kv_cache"]})
    assert refused.status_code == 400 and "requests run" in refused.json()["error"]["message"]
    running.join(timeout=120)
    assert len(result[0]) == 1500  # it ran on, untouched


async def test_the_trio_client_releases_and_resumes(server: ServerProcess) -> None:
    async with Client(server.url) as client:
        await client.release_memory_occupation(["kv_cache"])
        assert await client.is_sleeping()
        await client.resume_memory_occupation()
        assert not await client.is_sleeping()
