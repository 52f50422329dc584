"""Calls from the frontend to the actors that wait for an answer: pings and control messages.

Each call has a nonce; the actors' answer (`Pong`, `ControlDone`, `WeightValues`) carries it
back. A caller that leaves simply stops waiting, and a late answer is dropped; if the engine
dies, every waiting caller is woken to find out.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import trio

from runtime.frontend.outbox import Outbox
from runtime.wire.messages import ControlDone, Pong, WeightValues

Answer = Pong | ControlDone | WeightValues


class Calls:
    def __init__(self, outbox: Outbox) -> None:
        self._outbox = outbox
        self._waiting: dict[int, trio.Event] = {}
        self._answers: dict[int, Answer] = {}
        self._nonces = itertools.count()

    async def ask(self, make: Callable[[int], object]) -> Answer | None:
        """Send the message `make(nonce)` after everything queued so far; wait for its answer
        (None if `wake_all` woke us instead)."""
        nonce = next(self._nonces)
        answered = self._waiting[nonce] = trio.Event()
        self._outbox.send_after(make(nonce))
        try:
            await answered.wait()
        finally:
            del self._waiting[nonce]
        return self._answers.pop(nonce, None)

    def answer(self, nonce: int, msg: Answer) -> None:
        if nonce in self._waiting:  # else: its caller left
            self._answers[nonce] = msg
            self._waiting[nonce].set()

    def wake_all(self) -> None:
        for answered in self._waiting.values():
            answered.set()
