"""The one OS thread that runs a worker's torch work: loading, steps, and control ops.

OpenMP (libgomp: torch's parallel ops and our CPU kernels share it) keeps a pool of threads
for each thread that starts parallel regions. Between regions the pool spins a while, so the
next region starts at once, unless libgomp manages more threads than there are CPUs: then
they go to sleep at once and every region pays a wake-up. Two threads starting regions (the
model loaded in one, steps run in another) are enough for that on a 2-core machine. Measured
on SmolLM2 in float32 with 2 threads, a decode step's linears took 34 ms where one thread
doing all of it took 22 ms (a wake-up of ~100 us on each of the 120 small matrices). So every
piece of torch work a worker does goes through this one thread, in the order it was given.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from typing import TypeVar

import outcome
import trio

T = TypeVar("T")
CLOSE_GRACE = 5.0  # seconds `close` waits for the jobs before it to end


class TorchThread:
    def __init__(self, name: str = "torch") -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    async def run(self, fn: Callable[..., T], *args: object, abandon_on_cancel: bool = False) -> T:
        """`fn(*args)` on the torch thread, after the work given before it. As
        `trio.to_thread.run_sync`: the caller waits for the end even if cancelled, unless
        `abandon_on_cancel` (then the work runs on, and what comes after waits for it)."""
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        result: outcome.Outcome[T] | None = None

        def job() -> None:
            nonlocal result
            result = outcome.capture(fn, *args)
            # abandoned, its loop may have ended since
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(done.set)

        self._jobs.put(job)
        with trio.CancelScope(shield=not abandon_on_cancel):
            await done.wait()
        assert result is not None
        return result.unwrap()

    async def close(self, grace: float = CLOSE_GRACE) -> None:
        """Let the thread end after the work given so far, and wait for it (up to
        `grace` seconds, shielded from cancellation). What its last job held (a step's inputs, a
        bound method of the runner: the model's last reference, once the actor has let it
        go) is then freed before the interpreter shuts down; a daemon thread freeing torch
        tensors during shutdown aborts the process (SIGABRT, "terminate called without an
        active exception"). A job that never returns does not hold the process (the thread
        is a daemon, stuck outside Python)."""
        self._jobs.put(None)
        with trio.CancelScope(shield=True), trio.move_on_after(grace):
            await trio.to_thread.run_sync(self._thread.join, abandon_on_cancel=True)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()
            del job  # what it holds is freed now, not when the next job comes
