"""Accept HTTP connections and hand each to hypercorn, within bounds a client cannot stretch.

This replaces `hypercorn.trio.serve` (whose loop is about as short, see hypercorn/trio/run.py)
for two things it has no hook for:

- A cap on open connections (`max_connections`), so that a client holding hundreds of sockets
  cannot exhaust the process's file descriptors. At the cap a new connection evicts the one
  idle the longest (no request under way: a keep-alive connection between requests, or one
  that has not sent a whole request yet), so that sockets held open and silent cannot lock
  others out; only when every connection has a request under way is the new one refused, with
  a 503 and `Retry-After` (logged with its peer, rate-limited). Idle connections, including
  ones that never send a byte, end after `keep_alive_timeout` anyway.
- A send timeout (`send_timeout`): hypercorn sends in a shielded scope, so a client that stops
  reading held its connection, and its request's task, forever. Here each send that takes
  longer closes the connection; hypercorn then sees a broken stream, tells the app the client
  disconnected, and the request is cancelled (which aborts it in the engine).

Everything between the socket and the app (HTTP parsing, keep-alive, the ASGI calls) stays
hypercorn's, so this leans on its `TCPServer`, `Lifespan` and `WorkerContext`, which are not
documented API: pyproject pins hypercorn below the next minor version, and tests/test_connections.py
covers what we rely on.
"""

from __future__ import annotations

import errno
import json
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.events import Event, Updated
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState
from hypercorn.utils import repr_socket_addr, wrap_app

from api.http.refusal_log import RefusalLog

logger = logging.getLogger("runtime.server")

# A refused connection: how long we read (and drop) its request before closing, so that the
# kernel does not reset the connection with our 503 still unread (see keep_alive.BODY_LINGER).
# Beyond MAX_REFUSING such connections at once, new ones are closed without a word: lingering
# holds a file descriptor, and the cap exists to bound those.
REFUSAL_LINGER = 1.0
MAX_REFUSING = 64
# A send is cut into pieces of this size, each with its own deadline: the timeout is for a
# client that takes nothing, not for a slow one that reads a large answer steadily.
SEND_PIECE = 64 * 1024
EVICTION_TIMEOUT = 1.0  # seconds an evicted connection gets to end (it has nothing to finish)


class AddressError(ValueError):
    """The server's address cannot be bound or listened on (in use, not ours, unknown)."""


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    max_connections: int = 2048
    keep_alive_timeout: float = 5.0
    send_timeout: float = 30.0


@dataclass(slots=True)
class ConnectionStats:
    open: int = 0
    refused: int = 0
    refusing: int = 0  # refused connections still lingering
    send_timeouts: int = 0
    evicted: int = 0
    # open connections with no request under way, the one idle the longest first
    idle: dict[_Connection, None] = field(default_factory=dict)
    refusals: RefusalLog = field(default_factory=lambda: RefusalLog(logger))

    def count_send_timeout(self) -> None:
        self.send_timeouts += 1


async def serve_http(
    app: Any,
    config: Config,
    limits: ConnectionLimits,
    stats: ConnectionStats,
    *,
    host: str,
    port: int,
    shutdown_trigger: Callable[[], Awaitable[None]],
    sockets: Sequence[socket.socket] | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the ASGI `app` until `shutdown_trigger` returns, then give open connections
    `config.graceful_timeout` to finish. `started()` reports the bound URLs. `sockets`: bound
    beforehand by `bind_tcp(host, port)`; by default, bound here."""
    config.keep_alive_timeout = limits.keep_alive_timeout
    wrapped = wrap_app(app, config.wsgi_max_body_size, "asgi")
    lifespan = Lifespan(wrapped, config, {})
    context = WorkerContext(None)
    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        if sockets is None:
            sockets = await trio.to_thread.run_sync(bind_tcp, host, port)
        listeners = listen(sockets, config.backlog)
        async with trio.open_nursery() as connections:
            handler = partial(_connection, wrapped, config, context, limits, stats)
            async with trio.open_nursery() as accepting:
                await accepting.start(
                    partial(trio.serve_listeners, handler, listeners, handler_nursery=connections)
                )
                task_status.started([_url(listener) for listener in listeners])
                await shutdown_trigger()
                accepting.cancel_scope.cancel()  # closes the listeners
            await context.terminated.set()  # idle connections close, busy ones after their response
            connections.cancel_scope.deadline = trio.current_time() + config.graceful_timeout
        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()


def bind_tcp(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to every address `host` resolves to, not yet listening: a server binds
    before it loads anything, so that an address in use is found at once, and connections
    are refused (not queued) until it serves. Options as trio.open_tcp_listeners sets them."""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise AddressError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in addresses:
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past TIME_WAITs
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        raise _address_error(host, port, exc) from None
    return sockets


def listen(sockets: Sequence[socket.socket], backlog: int) -> list[trio.SocketListener]:
    """Start listening on sockets from `bind_tcp` (a server that bound the same port while
    we loaded, and listened first, makes this fail)."""
    for sock in sockets:
        try:
            sock.listen(backlog)
        except OSError as exc:
            host, port = sock.getsockname()[:2]
            raise _address_error(host, port, exc) from None
    return [trio.SocketListener(trio.socket.from_stdlib_socket(sock)) for sock in sockets]


def _address_error(host: str, port: int, exc: OSError) -> AddressError:
    hint = ""
    if exc.errno == errno.EADDRINUSE:
        hint = " (another server?): stop it, or choose another port (0 picks a free one)"
    return AddressError(f"cannot listen on {host}:{port}: {exc.strerror or exc}{hint}")


def _url(listener: trio.SocketListener) -> str:
    sock = listener.socket
    return "http://" + repr_socket_addr(sock.family, sock.getsockname())


async def _connection(
    app: Any,
    config: Config,
    context: WorkerContext,
    limits: ConnectionLimits,
    stats: ConnectionStats,
    stream: trio.SocketStream,
) -> None:
    if stats.open >= limits.max_connections and stats.idle:
        oldest = next(iter(stats.idle))
        stats.idle.pop(oldest)
        stats.evicted += 1
        await oldest.evict()
    if stats.open >= limits.max_connections:
        stats.refused += 1
        stats.refusals.note(
            f"refused a connection: all {limits.max_connections} have a request under way",
            _peer(stream),
        )
        if stats.refusing >= MAX_REFUSING:
            await stream.aclose()
            return
        stats.refusing += 1
        try:
            await _refuse(stream)
        finally:
            stats.refusing -= 1
        return
    stats.open += 1
    try:
        timed = TimedSendStream(stream, limits.send_timeout, stats)
        connection = _Connection(app, config, context, ConnectionState({}), timed)  # type: ignore[arg-type]
        connection.idle = stats.idle
        await connection.run()
    finally:
        stats.open -= 1


def _peer(stream: trio.SocketStream) -> str:
    try:
        return repr_socket_addr(stream.socket.family, stream.socket.getpeername())
    except OSError:  # gone already
        return "?"


class _Connection(TCPServer):
    """hypercorn's connection, which keeps its place in `idle` while it has no request
    under way, and can be evicted from there."""

    idle: dict[_Connection, None]

    async def run(self) -> None:
        self.ended = trio.Event()
        self.idle[self] = None  # no request yet
        try:
            await super().run()
        finally:
            self.idle.pop(self, None)
            self.ended.set()

    async def protocol_send(self, event: Event) -> None:
        if isinstance(event, Updated):
            self.idle.pop(self, None)
            if event.idle:
                self.idle[self] = None  # the newest idle one
        await super().protocol_send(event)

    async def evict(self) -> None:
        """Close the connection (it has no request under way); its reader sees the close
        and hypercorn ends the connection as if the client had. Returns once it has."""
        await self.stream.aclose()
        with trio.move_on_after(EVICTION_TIMEOUT):
            await self.ended.wait()

    async def _read_data(self) -> None:
        await super()._read_data()
        # The client closed its side: no request can come, yet hypercorn's keep-alive timer
        # would hold the connection (and its place under the cap) until it fires.
        await self.idle_task.stop()


_REFUSAL_BODY = json.dumps(
    {
        "error": {
            "message": "too many open connections; retry later",
            "type": "server_busy",
            "param": None,
            "code": "too_many_connections",
        }
    }
).encode()
_REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    b"retry-after: 1\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
    % (len(_REFUSAL_BODY), _REFUSAL_BODY)
)


async def _refuse(stream: trio.SocketStream) -> None:
    """503 without parsing anything: the cap exists because the process is near its limits."""
    with trio.move_on_after(REFUSAL_LINGER):
        try:
            await stream.send_all(_REFUSAL)
            await stream.send_eof()
            while await stream.receive_some(65536):
                pass  # the client's request: read, so that closing does not reset our answer
        except trio.BrokenResourceError:
            pass
    await stream.aclose()


class TimedSendStream(trio.abc.HalfCloseableStream):
    """A connection's socket stream whose sends give up after `timeout` seconds: the client
    stopped reading. Giving up closes the connection (see the module docstring)."""

    def __init__(self, stream: trio.SocketStream, timeout: float, stats: ConnectionStats) -> None:
        self._stream = stream
        self._timeout = timeout
        self._stats = stats

    @property
    def socket(self) -> trio.socket.SocketType:  # hypercorn reads the peer's address from it
        return self._stream.socket

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data)
        for start in range(0, max(len(view), 1), SEND_PIECE):
            with trio.move_on_after(self._timeout) as scope:  # inside hypercorn's shield: fires
                await self._stream.send_all(view[start : start + SEND_PIECE])
            if scope.cancelled_caught:
                await self._give_up()

    async def _give_up(self) -> None:
        self._stats.count_send_timeout()
        logger.warning("closing a connection: its client took no data for %.0f s", self._timeout)
        await self._stream.aclose()
        raise trio.BrokenResourceError("the client stopped reading")

    async def wait_send_all_might_not_block(self) -> None:
        await self._stream.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await self._stream.send_eof()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        return await self._stream.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self._stream.aclose()
