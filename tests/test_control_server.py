"""Pause and resume through HTTP on a real server (real model, float32, greedy): what crosses
processes, end to end."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from api.client import APIStatusError, Client
from tests.server_process import ServerProcess

PROMPT = {"text": "The tuple object", "sampling_params": {"temperature": 0, "ignore_eos": True}}


@pytest.fixture
def server(control_server: ServerProcess) -> ServerProcess:
    return control_server


def generate(server: ServerProcess, max_new_tokens: int) -> dict:
    body = PROMPT | {"sampling_params": PROMPT["sampling_params"] | {"max_new_tokens": 0}}
    body["sampling_params"]["max_new_tokens"] = max_new_tokens  # type: ignore[index]
    response = httpx.post(server.url + "/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def in_thread(fn: object, *args: object) -> tuple[threading.Thread, list]:
    result: list = []
    thread = threading.Thread(target=lambda: result.append(fn(*args)))  # type: ignore[operator]
    thread.start()
    return thread, result


def post(server: ServerProcess, path: str, **kwargs: object) -> dict:
    response = httpx.post(server.url + path, timeout=60, **kwargs)  # type: ignore[arg-type]
    assert response.status_code == 200, response.text
    return response.json()


def test_keep_freezes_a_stream_and_resume_gives_the_same_tokens(server: ServerProcess) -> None:
    expected = generate(server, 200)["output_ids"]
    body = PROMPT | {"stream": True}
    body["sampling_params"] = PROMPT["sampling_params"] | {"max_new_tokens": 200}
    counts = []
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=120) as response:
        events = (json.loads(line[6:]) for line in response.iter_lines() if line[6:7] == "{")
        last = next(events)
        post(server, "/pause_generation", json={"mode": "keep"})
        assert httpx.get(server.url + "/is_paused").json() == {"is_paused": True}
        reader, _ = in_thread(lambda: [counts.append(len(e["output_ids"])) for e in events])
        time.sleep(1.0)
        frozen = list(counts)
        time.sleep(1.0)
        assert counts == frozen and len(frozen) < 150  # nothing moved while paused
        post(server, "/continue_generation")
        reader.join(timeout=120)
    assert counts[-1] == 200 and last["output_ids"] == expected[: len(last["output_ids"])]
    final = generate(server, 200)["output_ids"]
    assert final == expected


def test_abort_ends_a_request_with_its_partial_output_and_holds_new_ones(
    server: ServerProcess,
) -> None:
    expected = generate(server, 1500)["output_ids"]
    running, result = in_thread(generate, server, 1500)
    deadline = time.monotonic() + 60
    running_one = 'runtime:num_requests_running{dp_rank="0"} 1.0'
    while running_one not in httpx.get(server.url + "/metrics").text:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.3)
    post(server, "/pause", params={"mode": "abort"})
    running.join(timeout=60)
    (partial,) = result
    assert partial["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(partial["output_ids"]) < 1500
    assert partial["output_ids"] == expected[: len(partial["output_ids"])]
    queued, later = in_thread(generate, server, 8)
    time.sleep(1.0)
    assert not later  # held while paused
    post(server, "/resume")
    queued.join(timeout=60)
    assert later[0]["output_ids"] == expected[:8]


async def test_the_trio_client_steers_the_server(server: ServerProcess) -> None:
    async with Client(server.url) as client:
        assert not await client.is_paused()
        await client.pause_generation("keep")
        assert await client.is_paused()
        await client.pause_generation("wait")  # a second pause changes nothing: a 200
        assert await client.is_paused()
        with pytest.raises(APIStatusError) as error:
            await client.pause_generation("sleep")
        assert error.value.status_code == 400
        await client.continue_generation()
        assert not await client.is_paused()


def test_abort_request_by_rid_flush_cache_and_model_info(server: ServerProcess) -> None:
    body = PROMPT | {"rid": "rollout-7"}
    body["sampling_params"] = PROMPT["sampling_params"] | {"max_new_tokens": 1500}
    running, result = in_thread(
        lambda: httpx.post(server.url + "/generate", json=body, timeout=120).json()
    )
    deadline = time.monotonic() + 60
    running_one = 'runtime:num_requests_running{dp_rank="0"} 1.0'
    while running_one not in httpx.get(server.url + "/metrics").text:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    response = httpx.post(server.url + "/flush_cache", timeout=60)
    assert response.status_code == 400 and "1 running" in response.json()["error"]["message"]
    aborted = httpx.post(server.url + "/abort_request", json={"rid": "rollout-7"}, timeout=60)
    assert aborted.status_code == 200
    running.join(timeout=60)
    assert result[0]["meta_info"]["finish_reason"]["type"] == "abort"
    assert result[0]["meta_info"]["weight_version"] == "default"
    assert post(server, "/flush_cache")["success"] is True
    info = httpx.get(server.url + "/get_model_info").json()
    assert info["weight_version"] == "default" and info["served_model_name"] == "tiny"
    assert info["is_generation"] is True and Path(info["model_path"]).is_dir()
