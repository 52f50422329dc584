"""Loads, server info, live settings, the generating health check and the log of a real
server."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trio

from api.client import APIStatusError, Client
from runtime.kernels.cpu import load_cpu_kernels
from tests.server_process import ServerProcess

LONG = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 150, "ignore_eos": True}}


@pytest.fixture(scope="module")
def server(llama_dir: Path) -> Iterator[ServerProcess]:
    load_cpu_kernels()  # built by now, if no earlier test did: the worker must find them
    proc = ServerProcess(llama_dir, "--dtype", "float32", "--enable-control-api")
    yield proc
    proc.terminate()


def test_the_log_is_lines_from_every_process_and_the_kernels_are_not_rebuilt(
    server: ServerProcess,
) -> None:
    """Logged to a file (here a pipe): no progress-bar frames, the worker process's lines too,
    and no compiling where this machine has built the CPU kernels already."""
    assert "Loading weights" not in server.log  # tqdm's frames (their \r reads as a newline here)
    assert re.search(r"INFO runtime\.worker\.loader: loaded \d+ tensors from", server.log)
    assert "compiling the CPU kernels" not in server.log


def requests_served(server: ServerProcess) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith("runtime:e2e_request_latency_seconds_count"):
            return float(line.split()[-1])
    return 0.0


def test_health_generate_generates_outside_the_request_metrics(server: ServerProcess) -> None:
    before = requests_served(server)
    assert httpx.get(server.url + "/health_generate", timeout=30).status_code == 200
    assert requests_served(server) == before
    info = httpx.get(server.url + "/get_server_info").json()
    assert info["dtype"] == "float32" and info["num_kv_blocks"] > 0
    assert info["block_size"] == 16 and info["internal_states"][0]["#running"] == 0


async def test_a_lower_max_num_seqs_holds_requests_in_the_queue(server: ServerProcess) -> None:
    """Three long requests with max_num_seqs 1: the load report shows one running and two
    waiting, then, back to the default, all three may run."""
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
        lowered = await http.post("/set_internal_state", json={"server_args": {"max_num_seqs": 1}})
        assert lowered.json() == [True]
        seen: list[tuple[int, int]] = []

        async def generate() -> None:
            response = await http.post("/generate", json=LONG)
            assert response.status_code == 200

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(generate)
            with trio.fail_after(60):
                while (1, 2) not in seen:
                    load = (await http.get("/v1/loads")).json()["loads"][0]
                    seen.append((load["num_running_reqs"], load["num_waiting_reqs"]))
                    assert load["num_running_reqs"] <= 1 and load["max_running_requests"] == 1
                    await trio.sleep(0.02)
        restored = {"server_args": {"max_running_requests": 128}}
        assert (await http.post("/set_internal_state", json=restored)).status_code == 200
        load = (await http.get("/v1/loads")).json()["loads"][0]
        assert load["max_running_requests"] == 128 and load["gen_throughput"] > 0
        refused = await http.post("/set_internal_state", json={"server_args": {"max_num_seqs": 0}})
        assert refused.status_code == 400


async def test_a_session_over_http(server: ServerProcess) -> None:
    """The trio client drives a two-turn session; the second turn equals a fresh request over
    the whole history and reads the history's KV from the cache."""
    greedy = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    first_prompt = list(range(3, 40))
    async with Client(server.url) as client:
        session = await client.open_session(1000)
        first = await client.generate(
            first_prompt, greedy, rid="turn-1", session_params={"id": session}
        )
        second = await client.generate([60, 61], greedy, session_params={"id": session})
        fresh = await client.generate(first_prompt + first["output_ids"] + [60, 61], greedy)
        assert second["output_ids"] == fresh["output_ids"]
        assert second["meta_info"]["cached_tokens"] == 32
        assert second["meta_info"]["prompt_tokens"] == 37 + 8 + 2
        await client.close_session(session)
        with pytest.raises(APIStatusError) as refused:
            await client.generate([1], greedy, session_params={"id": session})
        assert refused.value.status_code == 400
        assert await client.health_generate()
        assert (await client.loads())[0]["num_running_reqs"] == 0
