"""Calls from the frontend to the actors that wait for an answer: pings and control ops.

Each call has a nonce; the actors' answer (`Pong`, `ControlDone`) carries it back. A caller
that leaves simply stops waiting, and a late answer is dropped; if the engine dies, every
waiting caller is woken and gets `EngineDeadError`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import trio

from runtime.frontend.outbox import Outbox
from runtime.protocol import EngineDeadError
from runtime.wire.control import Control, ControlDone, ControlOp
from runtime.wire.messages import Ping, Pong, Probe

Answer = Pong | ControlDone
# Seconds the scheduler gets to answer a probe of its own: it answers at once when alive.
DIAGNOSE_TIMEOUT = 2.0
# A step's output this recent proves both actors alive, so a health check needs no round
# trip (which, queued behind a full batch's steps in flight, waits one or two steps).
FRESH_OUTPUT = 1.0


class Calls:
    def __init__(self, outbox: Outbox) -> None:
        self._outbox = outbox
        self._waiting: dict[int, trio.Event] = {}
        self._answers: dict[int, Answer] = {}
        self._nonces = itertools.count()
        self._dead: BaseException | None = None
        self._heard_at = -math.inf  # when a step's output last came

    async def control(self, op: ControlOp) -> tuple[float, ...]:
        """Apply a control op after everything queued so far: the values it read, or
        ValueError saying why it failed."""
        answer = await self._ask(lambda nonce: Control(nonce, op))
        assert isinstance(answer, ControlDone)
        if answer.error:
            raise ValueError(answer.error)
        return answer.values

    async def ping(self, *, through_worker: bool = True) -> Pong:
        """A round trip through both actors (or to the scheduler only), after everything
        queued before it."""
        answer = await self._ask(Ping if through_worker else Probe)
        assert isinstance(answer, Pong)
        return answer

    async def health(self, busy: str, outputs_prove_life: bool) -> str:
        """Return once both actors answer (`busy`: the worker is loading weights, and the
        scheduler answers for the engine), or at once after a fresh step output."""
        if busy:
            await self.ping(through_worker=False)
            return busy
        if not (outputs_prove_life and self.heard_within(FRESH_OUTPUT)):
            await self.ping()
        return ""

    async def diagnose(self) -> str:
        """Which actor is not answering, after a health check did not return in time."""
        with trio.move_on_after(DIAGNOSE_TIMEOUT):
            await self.ping(through_worker=False)
            return "the worker is not answering (the scheduler is)"
        return "the scheduler is not answering"

    def heard(self) -> None:
        """A step's output came: both actors were alive a moment ago."""
        self._heard_at = trio.current_time()

    def heard_within(self, seconds: float) -> bool:
        """Whether a step's output came within `seconds` (EngineDeadError if it is dead)."""
        self.check_alive()
        return trio.current_time() - self._heard_at < seconds

    def check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError("the engine is not running") from self._dead

    def fail(self, error: BaseException) -> None:
        """The engine is dead: every waiting caller wakes to find out."""
        self._dead = self._dead or error  # the first cause is the one to report
        for answered in self._waiting.values():
            answered.set()

    def answer(self, nonce: int, msg: Answer) -> None:
        if nonce in self._waiting:  # else: its caller left
            self._answers[nonce] = msg
            self._waiting[nonce].set()

    async def _ask(self, make: Callable[[int], object]) -> Answer:
        """Send the message `make(nonce)` after everything queued so far; wait for its answer."""
        self.check_alive()
        nonce = next(self._nonces)
        answered = self._waiting[nonce] = trio.Event()
        self._outbox.send_after(make(nonce))
        try:
            await answered.wait()
        finally:
            del self._waiting[nonce]
            answer = self._answers.pop(nonce, None)
        self.check_alive()  # woken by `fail`, not by an answer
        assert answer is not None
        return answer
