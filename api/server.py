"""Serve the app with hypercorn inside the caller's nursery, and drain it on shutdown.

Shutdown, once `shutdown` is set: we stop accepting connections; requests in flight get until
`drain_timeout` to finish; whatever still runs then is aborted, so its stream ends with a final
chunk (finish_reason "abort") and `[DONE]`. Idle keep-alive connections close at once, the
others after their response; once no request is open, whatever connection is left is closed.
A client that stopped reading holds its connection until the send timeout
(`api.http.connections`); if the process must exit sooner, that is the job of the process owner's
hard-exit watchdog (`runtime.cli.main`).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Sequence

import trio
from hypercorn.config import Config

from api.app import create_app, server_state
from api.http.connections import ConnectionLimits, serve_http
from api.http.keep_alive import KeepAliveMiddleware
from api.http.state import ServerSettings
from runtime.protocol import EngineClient

logger = logging.getLogger("runtime.server")

# After the last request ended: time for its final bytes to leave before connections close.
FLUSH_GRACE = 0.5
DEFAULT_LIMITS = ConnectionLimits()


async def serve(
    engine: EngineClient,
    settings: ServerSettings,
    *,
    host: str,
    port: int,
    shutdown: trio.Event,
    drain_timeout: float = 30.0,
    limits: ConnectionLimits = DEFAULT_LIMITS,
    sockets: Sequence[socket.socket] | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until `shutdown` is set, then drain. `started()` reports the bound URLs.
    `sockets`: bound beforehand (`bind_tcp(host, port)`, before the engine loads)."""
    app = create_app(engine, settings)
    config = Config()
    config.graceful_timeout = drain_timeout + 2 * FLUSH_GRACE  # our drain ends sooner
    config.accesslog = None
    config.errorlog = logging.getLogger("runtime.hypercorn")  # we log the URL ourselves
    config.backlog = 1024  # benchmark clients open hundreds of connections at once
    server_done = trio.Event()

    async def run_hypercorn(*, task_status: trio.TaskStatus[list[str]]) -> None:
        stats = server_state(app).connections
        await serve_http(
            KeepAliveMiddleware(app, limits.send_timeout, stats.count_send_timeout),
            config,
            limits,
            stats,
            host=host,
            port=port,
            shutdown_trigger=shutdown.wait,
            sockets=sockets,
            task_status=task_status,
        )
        server_done.set()

    async with trio.open_nursery() as nursery:
        task_status.started(await nursery.start(run_hypercorn))
        await shutdown.wait()
        server_state(app).draining = True
        await drain(engine, drain_timeout)
        with trio.move_on_after(FLUSH_GRACE):
            await server_done.wait()
        nursery.cancel_scope.cancel()  # only idle connections are left


async def drain(engine: EngineClient, seconds: float) -> None:
    """Wait for open requests to finish; abort those still open after `seconds`."""
    logger.info(
        "draining: %d requests in flight, %.0f s to finish",
        engine.statistics().frontend.num_requests_open,
        seconds,
    )
    with trio.move_on_after(seconds):
        await engine.wait_no_requests()
        return
    logger.warning(
        "drain deadline reached: aborting %d requests",
        engine.statistics().frontend.num_requests_open,
    )
    engine.abort_all()
    with trio.move_on_after(5.0):  # aborted streams end at once, unless their client is stuck
        await engine.wait_no_requests()
