"""Message channels over nng Pair0 sockets, on trio's fd fast path.

pynng's `arecv`/`asend` allocate an nng aio and hop threads on every call, which measured several
times slower under trio (STACK.md §2.2). Instead we try a non-blocking `recv`/`send` and, when nng
says TryAgain, park on the socket's pollable fd with `trio.lowlevel.wait_readable`. nng signals
*both* fds as readable (its send fd never reports writable), and one fd admits one waiter, so a
channel has one receiving task and serializes senders with a lock.

Pair0 applies backpressure (a full peer blocks the sender) and never drops a message, unlike
Pub/Sub or Bus; it also never re-sends, unlike Req0.
"""

from __future__ import annotations

import os
import uuid
from typing import Protocol

import pynng
import trio

import runtime.wire.messages  # noqa: F401 (registers every message's tag with the codec)
from runtime.wire.codec import decode, encode

# Messages in flight per direction before a sender waits. Steps are lock-step, so a handful is
# plenty; Submit bursts from the frontend are the only thing that can queue up.
_BUFFER = 64


class MessageChannel(Protocol):
    """What an actor needs of its link to a peer; tests inject in-memory ones."""

    async def send(self, msg: object) -> None: ...

    async def recv(self) -> object: ...


class Channel(MessageChannel):
    """A typed, bidirectional message pipe to one peer actor."""

    def __init__(self, sock: pynng.Socket) -> None:
        self._sock = sock
        self._recv_fd = sock.recv_fd
        self._send_fd = sock.send_fd
        self._send_lock = trio.Lock()

    @classmethod
    def listen(cls, address: str) -> Channel:
        sock = pynng.Pair0(recv_buffer_size=_BUFFER, send_buffer_size=_BUFFER)
        sock.listen(address)
        return cls(sock)

    @classmethod
    def dial(cls, address: str) -> Channel:
        sock = pynng.Pair0(recv_buffer_size=_BUFFER, send_buffer_size=_BUFFER)
        sock.dial(address, block=False)  # connects (and reconnects) in the background, quietly
        return cls(sock)

    async def send(self, msg: object) -> None:
        """Send one message; waits while the peer is absent or its buffer is full."""
        data = encode(msg)
        async with self._send_lock:
            while True:
                try:
                    self._sock.send(data, block=False)
                    break
                except pynng.TryAgain:
                    await trio.lowlevel.wait_readable(self._send_fd)
                except pynng.Closed:
                    raise trio.ClosedResourceError("the channel was closed") from None
        await trio.lowlevel.checkpoint_if_cancelled()

    async def recv(self) -> object:
        """Receive one message. Only one task may receive on a channel."""
        while True:
            try:
                data = self._sock.recv(block=False)
                break
            except pynng.TryAgain:
                await trio.lowlevel.wait_readable(self._recv_fd)
            except pynng.Closed:
                raise trio.ClosedResourceError("the channel was closed") from None
        return decode(data)

    def close(self) -> None:
        trio.lowlevel.notify_closing(self._recv_fd)
        trio.lowlevel.notify_closing(self._send_fd)
        self._sock.close()

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def inproc_address(name: str) -> str:
    """A private in-process address (actors as tasks of one trio.run)."""
    return f"inproc://runtime-{uuid.uuid4().hex[:12]}-{name}"


def ipc_address(directory: str, name: str) -> str:
    """An ipc:// address in a private directory; unix socket paths must stay short (< ~100 B)."""
    path = os.path.join(directory, f"{name}.ipc")
    if len(path) > 100:
        raise ValueError(f"ipc path too long for a unix socket: {path}")
    return f"ipc://{path}"
