"""Make every HTTP/1.1 response end its connection's cycle: keep it alive, or close it.

quart-trio answers a request in a task that its own `http.disconnect` handling cancels. The
last body message of a response reaches hypercorn in that task, and hypercorn finishes the
connection's cycle right there, after it has handed the app that disconnect: it recycles the
connection and starts its keep-alive timer, or closes it (`Connection: close`, HTTP/1.0, a body
left unread). The cancellation lands first, so none of that happened (measured): idle
connections stayed open forever, `Connection: close` and HTTP/1.0 were not honoured, and a
request answered before its body was read (a 404, a 401) left its connection deaf, so the next
request on it hung. `KeepAliveMiddleware` shields that last message.

It also decides what becomes of a connection whose request is answered before its body has
arrived: it waits briefly for the rest (then the connection lives on), else the response says
`Connection: close` so that no client sends its next request into a connection about to close.

And it bounds every send of a response by the send timeout. On HTTP/1 the socket's own send
timeout (`api.connections.TimedSendStream`) comes first and closes the connection; on HTTP/2 a
client can stall one stream by never opening its flow-control window, while the socket stays
writable. Past the deadline the request is cancelled (which aborts it in the engine), and the
shield of the last message can never hold a task forever.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import trio
from hypercorn.typing import ASGIReceiveEvent, ASGISendEvent

logger = logging.getLogger("runtime.server")

# How long an early answer waits for the rest of its request's body before it closes the
# connection instead. Closing with unread bytes makes the kernel reset the connection, which
# can destroy the answer before the client has read it; a body in flight usually lands sooner.
BODY_LINGER = 1.0
# The socket's send timeout should act first where it can (HTTP/1): it closes the connection.
SEND_DEADLINE_SLACK = 1.0

Receive = Any  # hypercorn.typing's ASGI callables, kept loose: Quart's are typed differently
Send = Any


class KeepAliveMiddleware:
    """Wraps an ASGI app; see the module docstring."""

    def __init__(
        self, app: Any, send_timeout: float, on_send_timeout: Callable[[], None] = lambda: None
    ) -> None:
        self.app = app
        self.send_timeout = send_timeout
        self.on_send_timeout = on_send_timeout

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body = _BodyWatch(receive)
        http1 = scope.get("http_version") in ("1.0", "1.1")  # HTTP/2 has no Connection header
        with trio.CancelScope() as request:
            sender = _ResponseSender(send, body, http1, request, self)
            await self.app(scope, body.receive, sender.send)


class _BodyWatch:
    """Passes the request's messages on, noting when its body has arrived whole."""

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self.complete = trio.Event()

    async def receive(self) -> ASGIReceiveEvent:
        message: ASGIReceiveEvent = await self._receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            self.complete.set()  # the whole body, or a disconnect: nothing more will come
        return message


class _ResponseSender:
    def __init__(
        self,
        send: Send,
        body: _BodyWatch,
        http1: bool,
        request: trio.CancelScope,
        middleware: KeepAliveMiddleware,
    ) -> None:
        self._send = send
        self._body = body
        self._http1 = http1
        self._request = request
        self._middleware = middleware

    async def send(self, message: ASGISendEvent) -> None:
        if message["type"] == "http.response.start" and self._http1:
            message = await self._start(message)
        last = message["type"] == "http.response.body" and not message.get("more_body", False)
        deadline = trio.current_time() + self._middleware.send_timeout + SEND_DEADLINE_SLACK
        with trio.CancelScope(deadline=deadline, shield=last) as sending:  # see the docstring
            await self._send(message)
        if sending.cancelled_caught:
            self._middleware.on_send_timeout()
            logger.warning("cancelling a request: its client took no data for its response")
            self._request.cancel()

    async def _start(self, message: Any) -> Any:
        with trio.move_on_after(BODY_LINGER):
            await self._body.complete.wait()
        if self._body.complete.is_set():
            return message
        headers = [*message.get("headers", []), (b"connection", b"close")]
        return {**message, "headers": headers}
