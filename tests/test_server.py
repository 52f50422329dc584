"""`runtime serve` end to end: the official openai client, our client, real sockets."""

from __future__ import annotations

import json
import os
import signal
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
import trio

from api.client import APIStatusError, Client
from tests.server_process import ServerProcess, metric, pid_alive, wait_until


@pytest.fixture(scope="module")
def server(llama_dir: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(llama_dir, "--max-model-len", "512", "--max-num-seqs", "64")
    yield proc
    assert proc.terminate() == 0, proc.log


@pytest.fixture(scope="module")
def oai(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_openai_completions_streamed_and_not(oai: openai.OpenAI) -> None:
    kwargs = {"model": "tiny", "prompt": "The tuple object", "max_tokens": 24, "temperature": 0}
    whole = oai.completions.create(**kwargs)
    chunks = list(
        oai.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert whole.choices[0].text and text == whole.choices[0].text
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 24
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 24


def test_openai_chat_streamed_and_not(oai: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Say something about lists."}]
    whole = oai.chat.completions.create(
        model="tiny", messages=messages, max_tokens=20, temperature=0
    )
    chunks = list(
        oai.chat.completions.create(
            model="tiny", messages=messages, max_tokens=20, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert whole.choices[0].message.content and text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_openai_client_sees_errors(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        oai.completions.create(model="nope", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        oai.completions.create(model="tiny", prompt="hi", max_tokens=600)
    assert oai.models.list().data[0].id == "tiny"


async def test_our_client(server: ServerProcess) -> None:
    async with Client(server.url) as client:
        assert await client.health()
        assert [m.id for m in await client.models()] == ["tiny"]
        whole = await client.completions("Hello", max_tokens=12, temperature=0)
        streamed = [
            c async for c in client.stream_completions("Hello", max_tokens=12, temperature=0)
        ]
        assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
        chat = await client.chat([{"role": "user", "content": "hi"}], max_tokens=5)
        assert chat.choices[0].message.role == "assistant" and chat.usage is not None
        deltas = [
            c async for c in client.stream_chat([{"role": "user", "content": "hi"}], max_tokens=5)
        ]
        assert deltas[0].choices[0].message.role == "assistant"
        with pytest.raises(APIStatusError) as error:
            await client.completions("hi", model="nope")
        assert error.value.status_code == 404 and error.value.code == "model_not_found"


async def test_cancelling_our_client_aborts_the_request(server: ServerProcess) -> None:
    async with Client(server.url) as client:
        with trio.move_on_after(30):  # a safety net, not the mechanism under test
            async for _ in client.stream_completions("Hi", max_tokens=400, ignore_eos=True):
                break  # leaving the loop closes the stream
    assert wait_until(lambda: metric(server, "runtime:num_requests_running") == 0)


async def test_a_request_id_is_a_label(server: ServerProcess) -> None:
    """/generate's rid: taken while its request runs (400), free the moment it ends (even
    while the scheduler still finishes the old one); text that is not Unicode is a 400."""
    # ignore_eos: a sampled end of sequence once ended the stream before the clashing request
    params = {"max_new_tokens": 500, "ignore_eos": True}
    body = {"text": "The tuple", "rid": "mine", "sampling_params": params}
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        for _ in range(4):
            async with http.stream("POST", "/generate", json=body | {"stream": True}) as stream:
                lines = stream.aiter_lines()  # held: a dropped iterator would close the stream
                async for line in lines:
                    if line.startswith("data: "):
                        break  # it runs
                clash = await http.post("/generate", json=body)
                assert clash.status_code == 400, clash.text
                assert "already in use" in clash.json()["error"]["message"]
            # the stream is closed: a disconnect, and the id is free at once
        short = {"sampling_params": {"max_new_tokens": 3}}
        again = await http.post("/generate", json=body | short)
        lone_surrogate = json.dumps(body | short | {"rid": "\ud800"})  # JSON allows it
        odd = await http.post("/generate", content=lone_surrogate)
    assert again.status_code == 200 and again.json()["meta_info"]["id"] == "mine"
    assert odd.status_code == 400 and "not valid Unicode" in odd.json()["error"]["message"]
    assert wait_until(lambda: metric(server, "runtime:num_requests_running") == 0)


async def test_disconnect_is_abort(server: ServerProcess) -> None:
    """50 streams closed after 3 chunks each leave nothing running and no KV in use."""
    body = {
        "model": "tiny",
        "prompt": "Once",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    got_three = 0
    async with httpx.AsyncClient(
        base_url=server.url, timeout=60, limits=httpx.Limits(max_connections=64)
    ) as http:

        async def stream_then_hang_up() -> None:
            nonlocal got_three
            async with http.stream("POST", "/v1/completions", json=body) as response:
                chunks = 0
                async for line in response.aiter_lines():
                    chunks += line.startswith("data: ")
                    if chunks == 3:
                        got_three += 1
                        break  # leaving `stream` closes the connection mid-response

        async with trio.open_nursery() as nursery:
            for _ in range(50):
                nursery.start_soon(stream_then_hang_up)
    assert got_three == 50
    assert wait_until(
        lambda: (
            metric(server, "runtime:num_requests_running") == 0
            and metric(server, "runtime:kv_cache_usage_perc") == 0
        )
    )
    assert metric(server, "runtime:num_requests_waiting") == 0
    assert metric(server, "runtime:generation_tokens_total") < 50 * 400  # stopped early


BAD_INPUTS = [
    ({"prompt": "hi"}, {}, 400),  # no model
    ({"model": "tiny", "prompt": "hi", "max_tokens": "many"}, {}, 400),
    ({"model": "tiny", "prompt": "hi", "temperature": 7}, {}, 400),
    ({"model": "tiny", "prompt": [1, 2, 99999]}, {}, 400),  # token id outside the vocabulary
    ({"model": "tiny", "prompt": "word " * 600}, {}, 400),  # longer than the context
    ({"model": "tiny", "prompt": "hi", "n": 99}, {}, 400),  # over --max-n
    ({"model": "tiny", "prompt": "hi", "seed": 2**70}, {}, 400),
    ({"model": "tiny", "prompt": "a\ud800b"}, {}, 400),  # a lone surrogate: not Unicode text
    ({"model": "nope", "prompt": "hi"}, {}, 404),
]


def post_json(url: str, body: dict, headers: dict | None = None) -> httpx.Response:
    """POST `body` as ASCII JSON, which (unlike httpx's json=) can carry a lone surrogate."""
    headers = {"Content-Type": "application/json"} | (headers or {})
    return httpx.post(url, content=json.dumps(body), headers=headers)


@pytest.mark.parametrize(("body", "headers", "status"), BAD_INPUTS)
def test_bad_input_over_http(server: ServerProcess, body: dict, headers: dict, status: int) -> None:
    response = post_json(server.url + "/v1/completions", body, headers)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    ok = httpx.post(
        server.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}
    )
    assert ok.status_code == 200


def test_top_k_beyond_the_vocabulary_keeps_every_token(server: ServerProcess) -> None:
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 4, "seed": 3, "top_k": 2**70}
    huge = httpx.post(server.url + "/v1/completions", json=body)
    assert huge.status_code == 200
    every = httpx.post(server.url + "/v1/completions", json=body | {"top_k": -1})
    assert huge.json()["choices"][0]["text"] == every.json()["choices"][0]["text"]


def test_text_that_is_not_unicode_is_a_400(server: ServerProcess) -> None:
    for path, body, param in [
        ("/tokenize", {"model": "tiny", "prompt": "a\ud800"}, "prompt"),
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": "\udfff"}]},
            "messages",
        ),
    ]:
        response = post_json(server.url + path, body)
        assert response.status_code == 400, path
        assert response.json()["error"]["param"] == param


def test_malformed_json_over_http(server: ServerProcess) -> None:
    response = httpx.post(
        server.url + "/v1/completions",
        content=b"{oops",
        headers={"Content-Type": "application/json"},
    )
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"


def test_api_key_and_sigterm_drain(llama_dir: Path) -> None:
    """With --api-key: 401 without it. On SIGTERM: in-flight requests finish or end with
    finish_reason "abort" at the drain deadline, the process exits 0, no child survives."""
    # the drain deadline must come before the request's 2000 tokens do: at 2 s it did not
    # always, once the tiny model's decode steps ran in one call (~1 ms a step, messaging
    # included); 2000 steps take over 0.3 s on any machine
    proc = ServerProcess(
        llama_dir, "--api-key", "k3y", "--drain-timeout", "0.3", "--max-model-len", "2048"
    )
    try:
        children = proc.child_pids()
        assert len(children) == 2
        assert httpx.get(proc.url + "/v1/models").status_code == 401
        auth = {"Authorization": "Bearer k3y"}
        assert httpx.get(proc.url + "/v1/models", headers=auth).status_code == 200
        long_body = {
            "model": "tiny",
            "prompt": "x",
            "max_tokens": 2000,
            "ignore_eos": True,
            "stream": True,
        }
        events: list[str] = []
        with httpx.stream(
            "POST", proc.url + "/v1/completions", json=long_body, headers=auth, timeout=60
        ) as response:
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    events.append(line)
                    break
            proc.process.send_signal(signal.SIGTERM)
            events += [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        final = json.loads(events[-2][len("data: ") :])
        assert final["choices"][0]["finish_reason"] == "abort"
        assert proc.process.wait(timeout=30) == 0
        assert wait_until(lambda: not any(pid_alive(p) for p in children), timeout=10)
        assert "drain deadline reached: aborting 1 requests" in proc.log
    finally:
        proc.terminate()


def last_events_after_first_chunk(
    proc: ServerProcess, max_tokens: int, act: Callable[[], None]
) -> list[str]:
    """Stream a completion, call `act` once the first chunk arrives, and return the payloads
    of every SSE event that follows it (the last is "[DONE]" when the stream ends cleanly)."""
    body = {"model": "tiny", "prompt": "x", "max_tokens": max_tokens, "ignore_eos": True}
    with httpx.stream(
        "POST", proc.url + "/v1/completions", json=body | {"stream": True}, timeout=60
    ) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        act()
        return [line[len("data: ") :] for line in lines if line.startswith("data: ")]


def test_sigterm_to_every_process_still_drains(llama_dir: Path) -> None:
    """systemd (KillMode=control-group) signals the actors too: they ignore it, the server
    drains its requests to the end and exits 0, and they exit with it."""
    proc = ServerProcess(llama_dir, "--drain-timeout", "30")
    try:
        children = proc.child_pids()

        def signal_every_process() -> None:
            for pid in [proc.process.pid, *children]:
                os.kill(pid, signal.SIGTERM)

        last = last_events_after_first_chunk(proc, 64, signal_every_process)
        assert last[-1] == "[DONE]"
        assert json.loads(last[-2])["choices"][0]["finish_reason"] == "length"
        assert proc.process.wait(timeout=30) == 0
        assert wait_until(lambda: not any(pid_alive(p) for p in children), timeout=10)
    finally:
        proc.terminate()


def test_a_dead_worker_is_reported_in_band_then_the_server_exits(llama_dir: Path) -> None:
    """Fail fast, but say why: the open stream gets an error event and [DONE], the server
    exits 1 with the cause in its log (for a process supervisor to restart it), no orphans."""
    proc = ServerProcess(llama_dir)
    try:
        children = proc.child_pids()
        roles = {Path(f"/proc/{p}/cmdline").read_text().split("\0")[3]: p for p in children}
        worker = roles["worker"]  # python -m runtime.processes.actor_main ROLE SPEC
        last = last_events_after_first_chunk(proc, 500, lambda: os.kill(worker, signal.SIGKILL))
        assert last[-1] == "[DONE]"
        error = json.loads(last[-2])["error"]
        assert error["code"] == "engine_dead" and "worker process exited" in error["message"]
        assert proc.process.wait(timeout=30) == 1
        assert "the worker process exited with code -9" in proc.log
        assert wait_until(lambda: not any(pid_alive(p) for p in children), timeout=10)
    finally:
        proc.terminate()


def test_a_stalled_reader_holds_no_slot_once_its_output_is_generated(llama_dir: Path) -> None:
    """Two clients that stop reading their streams fill --max-open-requests 2 while those
    generate; once both have all their output, the server serves others again."""
    proc = ServerProcess(llama_dir, "--max-open-requests", "2", "--send-timeout", "600")
    try:
        with (
            stalled_reader(proc, prompts=1, max_tokens=1500),
            stalled_reader(proc, prompts=1, max_tokens=1500),
        ):
            assert wait_until(
                lambda: metric(proc, "runtime:generation_tokens_total") >= 3000, timeout=60
            )
            body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
            response = httpx.post(proc.url + "/v1/completions", json=body, timeout=30)
            assert response.status_code == 200, response.text
    finally:
        proc.terminate()


def test_a_stalled_reader_is_cut_off_after_the_send_timeout(llama_dir: Path) -> None:
    """Its connection is closed, and its request aborted if it still generates."""
    proc = ServerProcess(llama_dir, "--send-timeout", "2")
    try:
        with stalled_reader(proc, prompts=1, max_tokens=2000):
            assert wait_until(lambda: metric(proc, "runtime:http_send_timeouts_total") == 1, 30)
            assert wait_until(lambda: metric(proc, "runtime:num_requests_running") == 0, 10)
            assert metric(proc, "runtime:http_connections_open") == 1  # this scrape's
    finally:
        proc.terminate()


@contextmanager
def stalled_reader(proc: ServerProcess, prompts: int, max_tokens: int) -> Iterator[None]:
    """A streaming completion whose client reads the status line, then nothing."""
    host, port = proc.url.removeprefix("http://").split(":")
    body = json.dumps(
        {
            "model": "tiny",
            "prompt": ["x"] * prompts if prompts > 1 else "x",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills up fast
        sock.connect((host, int(port)))
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: "
            b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        assert sock.recv(100).startswith(b"HTTP/1.1 200")
        yield


def test_a_stalled_reader_cannot_block_shutdown(llama_dir: Path) -> None:
    """A client that stops reading holds hypercorn's shielded send; the watchdog exits anyway."""
    proc = ServerProcess(llama_dir, "--drain-timeout", "1")
    try:
        children = proc.child_pids()
        with stalled_reader(proc, prompts=8, max_tokens=400):
            # ~550 kB of events; stop reading until all are generated (the send is stuck)
            assert wait_until(
                lambda: metric(proc, "runtime:generation_tokens_total") >= 3200, timeout=60
            )
            proc.process.send_signal(signal.SIGTERM)
            assert proc.process.wait(timeout=30) == 0
        assert "shutdown is stuck" in proc.log
        assert wait_until(lambda: not any(pid_alive(p) for p in children), timeout=10)
        assert not list(Path("/tmp").glob(f"rt-{proc.process.pid}-*"))  # os._exit: removed
    finally:
        proc.terminate()
