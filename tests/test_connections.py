"""Connection hygiene of the real HTTP server (hypercorn under api.http.connections), on real
sockets, against the fake engine: keep-alive ends, closes, caps and send timeouts."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import h2.config
import h2.connection
import h2.settings
import httpx
import pytest
import trio

from api.http import connections, keep_alive
from api.http.connections import ConnectionLimits
from api.http.state import ServerSettings
from api.server import serve
from tests.api_helpers import MODEL
from tests.fake_engine import FakeEngine

# Every wait below is for a behaviour with a deadline of its own; this only bounds a failure.
PATIENCE = 10.0


@dataclass
class Server:
    host: str
    port: int
    engine: FakeEngine

    async def connect(self) -> trio.SocketStream:
        return await trio.open_tcp_stream(self.host, self.port)


@asynccontextmanager
async def running_server(
    limits: ConnectionLimits = ConnectionLimits(keep_alive_timeout=0.3),  # noqa: B008
    **settings: object,
) -> AsyncIterator[Server]:
    engine = FakeEngine(max_model_len=10**6)
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        urls = await nursery.start(
            lambda task_status: serve(
                engine,
                ServerSettings(served_model_name=MODEL, **settings),  # type: ignore[arg-type]
                host="127.0.0.1",
                port=0,
                shutdown=shutdown,
                drain_timeout=1.0,
                limits=limits,
                task_status=task_status,
            )
        )
        host, port = urls[0].removeprefix("http://").split(":")
        yield Server(host, int(port), engine)
        shutdown.set()


def post(path: str, body: bytes, *headers: bytes, version: bytes = b"1.1") -> bytes:
    head = [b"POST %s HTTP/%s" % (path.encode(), version), b"Host: t", *headers]
    head.append(b"Content-Length: %d" % len(body))
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def get(path: str, *headers: bytes) -> bytes:
    return b"\r\n".join([b"GET %s HTTP/1.1" % path.encode(), b"Host: t", *headers]) + b"\r\n\r\n"


class Reader:
    """Reads HTTP/1.1 responses with a Content-Length off a connection, or up to its end."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buffer = b""

    async def _more(self) -> bool:
        with trio.fail_after(PATIENCE):
            data = await self.stream.receive_some(65536)
        self.buffer += data
        return bool(data)

    async def response(self) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.buffer:
            assert await self._more(), f"closed before a response: {self.buffer!r}"
        head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        status_line, *lines = head.decode().split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines)
        length = int(headers["content-length"])
        while len(self.buffer) < length:
            assert await self._more()
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return int(status_line.split()[1]), headers, body

    async def until_closed(self) -> bytes:
        """Everything up to the server closing the connection (fails if it never does)."""
        while await self._more():
            pass
        return self.buffer


async def eventually(condition: Callable[[], bool]) -> None:
    with trio.fail_after(PATIENCE):
        while not condition():  # noqa: ASYNC110 (the fake engine has no event for this)
            await trio.sleep(0.01)


def metric(exposition: bytes, name: str) -> float:
    line = next(x for x in exposition.decode().splitlines() if x.startswith(name + " "))
    return float(line.split()[1])


COMPLETION = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 3}).encode()
JSON = b"Content-Type: application/json"
HEADERS = {"Content-Type": "application/json"}
ENDLESS = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 10**5, "stream": True}).encode()


async def test_idle_keep_alive_connections_are_closed() -> None:
    async with running_server() as server:
        never_used = await server.connect()
        used = await server.connect()
        await used.send_all(get("/health"))
        reader = Reader(used)
        assert (await reader.response())[0] == 200
        assert await reader.until_closed() == b""  # after keep_alive_timeout
        assert await Reader(never_used).until_closed() == b""


async def test_keep_alive_serves_requests_in_turn_on_one_connection() -> None:
    async with running_server() as server:
        stream = await server.connect()
        reader = Reader(stream)
        for _ in range(3):
            await stream.send_all(post("/v1/completions", COMPLETION, JSON))
            status, headers, body = await reader.response()
            assert status == 200 and "connection" not in headers
            assert json.loads(body)["choices"][0]["text"] == "alpha beta gamma "


async def test_connection_close_is_honoured() -> None:
    async with running_server() as server:
        stream = await server.connect()
        await stream.send_all(get("/health", b"Connection: close"))
        assert (await Reader(stream).until_closed()).startswith(b"HTTP/1.1 200")


async def test_an_http_1_0_stream_ends_with_its_connection() -> None:
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True}).encode()
    async with running_server() as server:
        stream = await server.connect()
        await stream.send_all(post("/v1/completions", body, JSON, version=b"1.0"))
        assert (await Reader(stream).until_closed()).endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize("path", ["/nowhere", "/v1/completions"])  # 404; 401 (api key)
async def test_an_answer_before_the_body_keeps_its_connection_usable(path: str) -> None:
    """The body arrives after the answer (the client sent its headers first): the next
    request on that connection is answered, as clients like `openai` expect."""
    async with running_server(api_key="k") as server:
        stream = await server.connect()
        head = post(path, COMPLETION, JSON)
        await stream.send_all(head[: -len(COMPLETION)])
        reader = Reader(stream)
        await trio.sleep(0.05)  # the server answers in this time, without the body
        await stream.send_all(COMPLETION)
        status, headers, _ = await reader.response()
        assert status in (401, 404) and "connection" not in headers
        await stream.send_all(get("/health"))
        assert (await reader.response())[0] == 200


async def test_an_answer_whose_body_never_comes_closes_the_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It says so (`Connection: close`), so that the client does not send into it."""
    monkeypatch.setattr(keep_alive, "BODY_LINGER", 0.1)
    # not the default 0.3 s keep-alive: under load (CI once) that idle timer closed the
    # connection before the server had read the request
    async with running_server(ConnectionLimits(keep_alive_timeout=5)) as server:
        stream = await server.connect()
        await stream.send_all(post("/nowhere", COMPLETION)[: -len(COMPLETION)])
        reader = Reader(stream)
        status, headers, _ = await reader.response()
        assert status == 404 and headers["connection"] == "close"
        assert await reader.until_closed() == b""


async def test_at_the_cap_a_new_connection_evicts_the_one_idle_the_longest() -> None:
    """Sockets held open and silent cannot lock anyone out: they are evicted, oldest first."""
    limits = ConnectionLimits(max_connections=4, keep_alive_timeout=60)
    async with running_server(limits) as server:
        silent = [await server.connect() for _ in range(3)]
        probe = await server.connect()
        with trio.fail_after(PATIENCE):
            while True:  # until the server holds all four
                await probe.send_all(get("/metrics"))
                _, _, exposition = await Reader(probe).response()
                if metric(exposition, "runtime:http_connections_open") == 4:
                    break
        newcomers = []
        for _ in range(6):  # each one evicts the connection idle the longest, silent first
            newcomers.append(stream := await server.connect())
            await stream.send_all(get("/health"))
            assert (await Reader(stream).response())[0] == 200  # and stays open, idle
        for stream in silent:
            assert await Reader(stream).until_closed() == b""
        stream = await server.connect()
        await stream.send_all(get("/metrics"))
        _, _, body = await Reader(stream).response()
        assert metric(body, "runtime:http_connections_evicted_total") >= 3
        assert metric(body, "runtime:http_connections_refused_total") == 0


async def test_connections_beyond_the_cap_get_503_when_all_are_busy(
    caplog: pytest.LogCaptureFixture,
) -> None:
    limits = ConnectionLimits(max_connections=2, keep_alive_timeout=60)
    async with running_server(limits) as server:
        busy = [await server.connect() for _ in range(2)]
        for stream in busy:  # each streams an answer that does not end
            await stream.send_all(post("/v1/completions", ENDLESS, JSON))
            assert (await stream.receive_some(100)).startswith(b"HTTP/1.1 200")
        with caplog.at_level(logging.WARNING, logger="runtime.server"):
            for _ in range(3):
                refused = await server.connect()
                await refused.send_all(get("/health"))
                reader = Reader(refused)
                status, headers, answer = await reader.response()
                assert status == 503 and headers["retry-after"] == "1"
                assert json.loads(answer)["error"]["code"] == "too_many_connections"
                assert await reader.until_closed() == b""
        lines = [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]
        assert len(lines) == 1 and "127.0.0.1" in lines[0]  # with the peer, rate-limited
        await busy[1].aclose()
        with trio.fail_after(PATIENCE):
            while True:  # the server notices the close as soon as it reads
                stream = await server.connect()
                await stream.send_all(get("/metrics"))
                status, _, metrics = await Reader(stream).response()
                if status == 200:
                    break
                await trio.sleep(0.01)
        assert metric(metrics, "runtime:http_connections_refused_total") >= 3
        await busy[0].aclose()  # its endless stream would hold the shutdown up


async def test_a_connection_that_sends_nothing_or_half_a_request_is_closed() -> None:
    async with running_server(ConnectionLimits(keep_alive_timeout=0.3)) as server:
        silent, half = await server.connect(), await server.connect()
        await half.send_all(b"GET /health HTTP/1.1\r\nHost:")
        with trio.fail_after(PATIENCE):
            assert await Reader(silent).until_closed() == b""
            assert await Reader(half).until_closed() == b""


async def test_a_client_that_stops_reading_loses_its_connection_and_request() -> None:
    limits = ConnectionLimits(send_timeout=0.5)
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 10**5, "stream": True}).encode()
    async with running_server(limits) as server:
        stream = await server.connect()
        stream.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVBUF, 4096)
        await stream.send_all(post("/v1/completions", body, JSON))
        await eventually(lambda: bool(server.engine.requests))
        rid = server.engine.requests[0][2]
        await eventually(lambda: rid in server.engine.aborted)  # the send timed out: cancelled
        assert rid not in server.engine.finished
        with trio.fail_after(PATIENCE), contextlib.suppress(trio.BrokenResourceError):
            while await stream.receive_some(2**20):  # what was sent before, then the close
                pass
        probe = await server.connect()
        await probe.send_all(get("/metrics"))
        _, _, metrics = await Reader(probe).response()
        assert metric(metrics, "runtime:http_send_timeouts_total") == 1


async def test_http2_prior_knowledge_is_served_too() -> None:
    """HTTP/2 has no Connection header: an early answer must not try to send one."""
    async with running_server() as server:
        url = f"http://{server.host}:{server.port}"
        async with httpx.AsyncClient(http1=False, http2=True, base_url=url) as http:
            response = await http.post("/nowhere", json={"a": 1})
            assert (response.http_version, response.status_code) == ("HTTP/2", 404)
            response = await http.post("/v1/completions", content=COMPLETION, headers=HEADERS)
            assert response.status_code == 200


@pytest.mark.parametrize(("version", "closes"), [("1.1", True), ("1.0", True), ("2", False)])
async def test_only_http_1_answers_say_connection_close(
    version: str, closes: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An early answer whose body never comes: HTTP/2 forbids the header (a stream ends alone)."""
    monkeypatch.setattr(keep_alive, "BODY_LINGER", 0.01)
    sent: list[dict[str, Any]] = []

    async def app(scope: object, receive: object, send: Any) -> None:
        await send({"type": "http.response.start", "status": 404, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def body_never_comes() -> None:
        await trio.sleep_forever()

    async def record(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "http_version": version}
    await keep_alive.KeepAliveMiddleware(app, send_timeout=1.0)(scope, body_never_comes, record)
    assert ((b"connection", b"close") in sent[0]["headers"]) == closes


async def test_an_http2_stream_whose_window_stays_shut_is_cancelled() -> None:
    """The socket stays writable (hypercorn buffers the stream's data), so only the response's
    own deadline can end it; once the client leaves, nothing of its connection is left."""
    stream_body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1000, "stream": True})
    async with running_server(ConnectionLimits(send_timeout=0.2)) as server:
        stream = await server.connect()
        h2_client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        h2_client.local_settings = h2.settings.Settings(
            client=True, initial_values={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0}
        )
        h2_client.initiate_connection()
        headers = [(":method", "POST"), (":path", "/v1/completions"), (":scheme", "http")]
        h2_client.send_headers(
            1, [*headers, (":authority", "t"), ("content-type", "application/json")]
        )
        h2_client.send_data(1, stream_body.encode(), end_stream=True)
        await stream.send_all(h2_client.data_to_send())
        await until_metric(server, "runtime:http_send_timeouts_total", lambda n: n == 1)
        assert not server.engine.open  # the request's task is gone
        await stream.aclose()
        # the scrape's own connection is the only one left
        await until_metric(server, "runtime:http_connections_open", lambda n: n == 1)


async def until_metric(server: Server, name: str, ok: Callable[[float], bool]) -> None:
    with trio.fail_after(PATIENCE):
        while not ok(metric(await scrape(server), name)):  # noqa: ASYNC110 (polls /metrics)
            await trio.sleep(0.05)


async def scrape(server: Server) -> bytes:
    probe = await server.connect()
    await probe.send_all(get("/metrics"))
    _, _, metrics = await Reader(probe).response()
    await probe.aclose()
    return metrics


async def test_refusals_beyond_a_few_are_closed_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refusal lingers to deliver its 503; lingering refusals are bounded, like connections."""
    monkeypatch.setattr(connections, "MAX_REFUSING", 1)
    async with running_server(ConnectionLimits(max_connections=1, keep_alive_timeout=60)) as server:
        held = await server.connect()  # busy: it streams an answer that does not end
        await held.send_all(post("/v1/completions", ENDLESS, JSON))
        assert (await held.receive_some(100)).startswith(b"HTTP/1.1 200")
        lingering = await server.connect()  # sends nothing: its refusal lingers
        assert (await Reader(lingering).response())[0] == 503
        dropped = await server.connect()
        assert await Reader(dropped).until_closed() == b""  # not even a 503
        await held.aclose()  # its endless stream would hold the shutdown up


async def test_a_slow_client_that_keeps_reading_gets_its_whole_answer() -> None:
    """The send timeout is for a client that takes nothing, not for a large answer read
    steadily for longer than the timeout."""
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 100_000}).encode()
    async with running_server(ConnectionLimits(send_timeout=0.5)) as server:
        stream = await server.connect()
        stream.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVBUF, 16384)
        await stream.send_all(post("/v1/completions", body, JSON))
        received = b""
        started = trio.current_time()
        while b'"usage"' not in received[-400:]:
            with trio.fail_after(PATIENCE):
                data = await stream.receive_some(16384)
            assert data, "the server closed the connection"
            received += data
            await trio.sleep(0.02)  # about 800 kB/s
        assert len(received) > 500_000 and trio.current_time() - started > 0.5
