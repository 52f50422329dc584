"""The engine's `start_profile` / `stop_profile`: every actor records its steps into its own
Chrome trace file (runtime/tracing.py), the worker with `torch.profiler`."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Sequence

import trio

from runtime.tracing import PhaseTrace, ProfileRequest
from runtime.wire.messages import StartProfile, StopProfile

ACTIVITIES = ("CPU", "GPU")


class ProfileCalls:
    """Mixed into the engine: it has `trace` (its own PhaseTrace) and `control`."""

    trace: PhaseTrace
    _profiling: ProfileRequest | None = None
    control: Callable[[Callable[[int], object]], Awaitable[None]]  # the engine's

    @property
    def is_profiling(self) -> bool:
        """A profile runs (one with `num_steps` ends by itself)."""
        return self._profiling is not None and (self.trace.on or not self._profiling.num_steps)

    async def start_profile(
        self,
        output_dir: str,
        num_steps: int | None = None,
        activities: Sequence[str] = ("CPU",),
        record_shapes: bool = False,
        with_stack: bool = False,
    ) -> None:
        """Trace every actor's steps into `output_dir` until `stop_profile`, or for
        `num_steps` steps; ValueError if a profile runs or the folder cannot be made."""
        if self.is_profiling:
            raise ValueError("a profile is running: stop_profile first")
        unknown = sorted(set(activities) - set(ACTIVITIES))
        if unknown or not activities:
            raise ValueError(f"activities must be among {', '.join(ACTIVITIES)}, got {unknown}")
        if num_steps is not None and num_steps < 1:
            raise ValueError(f"num_steps must be at least 1, not {num_steps}")
        try:
            await trio.Path(output_dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"cannot write profiles to {output_dir}: {exc}") from None
        request = ProfileRequest(
            output_dir, num_steps or 0, tuple(activities), record_shapes, with_stack
        )
        self._profiling = request
        self.trace.start(request)
        with trio.CancelScope(shield=True):  # the actors start whether the caller waits or not
            try:
                await self.control(lambda nonce: StartProfile(nonce, request))
            except ValueError:  # an actor refused: every actor stops again
                self._profiling = None
                self.trace.discard()
                with contextlib.suppress(ValueError):
                    await self.control(StopProfile)
                raise

    async def stop_profile(self) -> None:
        """Stop profiling; once it returns, every actor's trace file is written."""
        if not self.is_profiling:
            raise ValueError("no profile is running")
        self._profiling = None
        problem = self.trace.stop()
        await self.control(StopProfile)  # ValueError if an actor could not write its trace
        if problem:
            raise ValueError(problem)
