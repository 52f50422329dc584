"""The engine's control part (`engine.control`, a `ControlClient`): pause and resume, cache
flush, live settings, memory release, profiles; and the turn that weight updates take
(runtime/frontend/weights.py).

What a reinforcement-learning loop does between rollouts (generate, pause, load the trainer's
weights, flush stale KV, resume), built on control ops (runtime/wire/control.py) that the
actors apply in order with everything else the engine sent. Calls that change what runs take
turns (a lock), so none sees another's half-done state: a resume slipping into a memory
release, a user's pause into an update.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import trio

from runtime.frontend.calls import Calls
from runtime.frontend.open_requests import OpenRequests
from runtime.frontend.profiling import profile_request
from runtime.frontend.weight_sources import ServedVersion, memory_tags
from runtime.tracing import PhaseTrace, ProfileRequest
from runtime.wire import control as ops

PAUSE_MODES = ("abort", "wait", "keep", "retract")
# What set_internal_state may change; SGLang calls max_num_seqs max_running_requests.
LIVE_SETTINGS = ("max_num_seqs", "max_running_requests")


class EngineControl:
    def __init__(
        self, calls: Calls, requests: OpenRequests, trace: PhaseTrace, served: ServedVersion
    ) -> None:
        self._calls = calls
        self._requests = requests
        self._trace = trace  # the frontend's own, while profiling
        self._served = served  # which weights serve: a reload from disk changes it
        self._lock = trio.Lock()
        self._paused = False
        self._released: set[str] = set()  # memory given back (release_memory_occupation)
        self._operation: tuple[str, float] | None = None  # a long call: what, since when
        self._paused_to_sleep = False  # the release paused generation: the resume unpauses
        self._profiling: ProfileRequest | None = None

    # -- pause, resume, cache, settings ---------------------------------------------------

    @property
    def is_paused(self) -> bool:
        return self._paused

    async def pause(self, mode: str = "abort") -> bool:
        """Pause (see `_pause`); False if the engine was paused already, and then nothing
        changes: callers with several trainer ranks pause more than once."""
        self._calls.check_alive()
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {', '.join(PAUSE_MODES)}, not {mode!r}")
        async with self._lock:
            if self._paused:
                return False
            await self._pause(mode)
            return True

    async def resume(self) -> None:
        async with self._lock:
            await self._resume()

    async def _pause(self, mode: str) -> None:
        """Stop generating until `resume`. Requests that arrive meanwhile are queued, in order.

        "abort": every open request ends now with finish_reason "abort" and the output it has;
        returns once nothing runs and its KV is free. "wait": open requests finish normally;
        returns when the last has. "keep": freezes at the next step boundary with the KV kept;
        `resume` continues them as if nothing happened. "retract": as "keep", but their KV is
        freed; on `resume` they are recomputed from their tokens and go on.
        """
        assert not self._paused
        self._paused = True
        if mode == "abort":
            self._requests.abort_all()  # leaves before the pause: their KV is freed first
        await self._calls.control(ops.Pause("keep" if mode == "abort" else mode))

    async def _resume(self) -> None:
        """Continue after `pause` (a no-op if not paused)."""
        if self._released:
            raise ValueError(
                f"the engine's {' and '.join(sorted(self._released))} memory is released: "
                "resume_memory_occupation first"
            )
        if self._paused:
            await self._calls.control(ops.Resume())
            self._paused = False

    async def flush_cache(self, force: bool = False) -> None:
        """Drop the prefix cache; ValueError naming the counts while any request is open,
        unless `force` (then the running requests keep their KV, but nobody shares it)."""
        await self._calls.control(ops.FlushCache(force))

    async def set_internal_state(self, settings: Mapping[str, Any]) -> None:
        """Change the settings that may change live (LIVE_SETTINGS); ValueError naming any
        other, or a bad value, and then nothing changes."""
        others = sorted(set(settings) - set(LIVE_SETTINGS))
        if set(LIVE_SETTINGS) <= settings.keys():
            raise ValueError(f"give one of {' or '.join(LIVE_SETTINGS)}, not both (aliases)")
        if others:
            raise ValueError(
                f"cannot change {', '.join(others)} while serving; these can: "
                f"{', '.join(LIVE_SETTINGS)}"
            )
        value = settings.get("max_num_seqs", settings.get("max_running_requests"))
        if value is not None:
            if type(value) is not int or value < 1:
                raise ValueError(f"max_num_seqs must be an integer >= 1, not {value!r}")
            async with self._lock:
                await self._calls.control(ops.Configure(value))

    @asynccontextmanager
    async def exclusive(
        self, what: str, *, abort_open: bool, keep_pause: bool
    ) -> AsyncIterator[int]:
        """A change no other control call may see half-done (a weight update, named `what`):
        it holds the turn, with nothing computing. Not paused: new requests wait while open
        ones finish (or are aborted, with `abort_open`), and everything resumes after (unless
        `keep_pause`). Yields how many requests were open; ValueError if the weights are
        released. Shielded: a caller that leaves does not stop the change midway."""
        async with self._lock:
            if "weights" in self._released:
                raise ValueError("the weights are released: resume_memory_occupation first")
            num_open = len(self._requests)
            with trio.CancelScope(shield=True), self._doing(what):
                pausing = not self._paused
                if pausing:
                    await self._pause("abort" if abort_open else "wait")
                try:
                    yield num_open
                finally:
                    if pausing and not keep_pause:
                        await self._resume()

    @property
    def busy(self) -> str:
        """The long control call under way, and for how long ("" if none): health checks
        say it instead of waiting on a worker that is loading weights."""
        if self._operation is None:
            return ""
        what, since = self._operation
        return f"{what} for {trio.current_time() - since:.1f} s"

    @contextlib.contextmanager
    def _doing(self, what: str) -> Iterator[None]:
        self._operation = (what, trio.current_time())
        try:
            yield
        finally:
            self._operation = None

    # -- memory -----------------------------------------------------------------------------

    @property
    def is_sleeping(self) -> bool:
        return bool(self._released)

    async def release_memory_occupation(
        self, tags: list[str] | None = None, *, pause_mode: str = "keep"
    ) -> None:
        """Free the KV pool and/or the weights (default both) for a colocated trainer; the
        memory is returned before this returns. Only while no request runs or waits: if not
        paused, it pauses in `pause_mode` first ("keep" refuses while requests run; "abort"
        ends them; "wait" lets them finish). Generation stays paused (new requests wait) until
        `resume_memory_occupation` has brought everything back."""
        wanted = memory_tags(tags)
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {', '.join(PAUSE_MODES)}, not {pause_mode!r}")
        async with self._lock:
            if not self._paused:
                await self._pause(pause_mode)  # holds new requests; nothing in flight after
                self._paused_to_sleep = True
            try:
                with self._doing("release_memory_occupation"):
                    await self._calls.control(ops.ReleaseMemory(wanted))
            except ValueError:
                if self._paused_to_sleep and not self._released:
                    self._paused_to_sleep = False
                    await self._resume()
                raise
            self._released.update(wanted)

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Bring back what `release_memory_occupation` freed (default both): a fresh KV pool,
        the weights reloaded from their last source. ValueError if that fails."""
        async with self._lock:
            wanted = tuple(t for t in memory_tags(tags) if t in self._released)
            if wanted:
                with self._doing("resume_memory_occupation"):
                    await self._calls.control(ops.ResumeMemory(wanted))
                self._released.difference_update(wanted)
                if "weights" in wanted:  # reloaded from their checkpoint: updates are gone
                    self._served.reloaded()
            if not self._released and self._paused_to_sleep:
                self._paused_to_sleep = False
                await self._resume()

    # -- profiles ---------------------------------------------------------------------------

    @property
    def is_profiling(self) -> bool:
        """A profile runs (one with `num_steps` ends by itself)."""
        request = self._profiling
        return request is not None and (self._trace.on or not request.num_steps)

    async def start_profile(self, output_dir: str | None = None, num_steps: int | None = None,
                            activities: Sequence[str] = ("CPU",), record_shapes: bool = False,
                            with_stack: bool = False) -> str:  # fmt: skip
        """Trace every actor's steps into `output_dir` (None: a new private folder) until
        `stop_profile`, or for `num_steps` steps; returns the folder. ValueError if a profile
        runs or the folder cannot be made."""
        if self.is_profiling:
            raise ValueError("a profile is running: stop_profile first")
        try:
            if output_dir is None:
                output_dir = tempfile.mkdtemp(prefix="runtime-profile-")
            await trio.Path(output_dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"cannot write profiles to {output_dir}: {exc}") from None
        request = profile_request(output_dir, num_steps, activities, record_shapes, with_stack)
        self._profiling = request
        self._trace.start(request)
        with trio.CancelScope(shield=True):  # the actors start whether the caller waits or not
            try:
                await self._calls.control(ops.StartProfile(request))
            except ValueError:  # an actor refused: every actor stops again
                self._profiling = None
                self._trace.discard()
                with contextlib.suppress(ValueError):
                    await self._calls.control(ops.StopProfile())
                raise
        return output_dir

    async def stop_profile(self) -> None:
        """Stop profiling; once it returns, every actor's trace file is written."""
        if not self.is_profiling:
            raise ValueError("no profile is running")
        self._profiling = None
        problem = self._trace.stop()
        await self._calls.control(ops.StopProfile())  # ValueError if an actor could not write
        if problem:
            raise ValueError(problem)
