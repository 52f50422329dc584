"""The engine's control part (`engine.control`, a `ControlClient`): pause and resume, cache
flush, live settings, weight updates, memory release, profiles.

What a reinforcement-learning loop does between rollouts (generate, pause, load the trainer's
weights, flush stale KV, resume), built on control ops (runtime/wire/control.py) that the
actors apply in order with everything else the engine sent. Calls that change what runs take
turns (a lock), so none sees another's half-done state: a resume slipping into a memory
release, a user's pause into an update.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import trio

from runtime.frontend.calls import Calls
from runtime.frontend.open_requests import OpenRequests
from runtime.frontend.profiling import profile_request
from runtime.frontend.weight_sources import (
    announcement_problem,
    group_problem,
    memory_tags,
    save_safetensors,
    temporary_file,
)
from runtime.protocol import EngineDeadError, NamedTensors
from runtime.tracing import PhaseTrace, ProfileRequest
from runtime.wire import control as ops

PAUSE_MODES = ("abort", "wait", "keep")
# What set_internal_state may change; SGLang calls max_num_seqs max_running_requests.
LIVE_SETTINGS = ("max_num_seqs", "max_running_requests")
MAX_WEIGHT_VALUES = 100_000  # what get_weights_by_name may return: a check, not a download


class EngineControl:
    def __init__(
        self,
        calls: Calls,
        requests: OpenRequests,
        trace: PhaseTrace,
        model_path: str,
        data_parallel_size: int = 1,
    ) -> None:
        self._calls = calls
        self._requests = requests
        self._trace = trace  # the frontend's own, while profiling
        self._workers = data_parallel_size  # each a rank of a trainer's weight group
        self._lock = trio.Lock()
        self._paused = False
        self.model_path = model_path
        self.weight_version = "default"  # as SGLang names the weights a server started with
        self._checkpoint_version = self.weight_version  # that of the weights at model_path
        self._released: set[str] = set()  # memory given back (release_memory_occupation)
        self._paused_to_sleep = False  # the release paused generation: the resume unpauses
        self._profiling: ProfileRequest | None = None

    # -- pause, resume, cache, settings ---------------------------------------------------

    @property
    def is_paused(self) -> bool:
        return self._paused

    async def pause(self, mode: str = "abort") -> None:
        self._calls.check_alive()
        async with self._lock:
            await self._pause(mode)

    async def resume(self) -> None:
        async with self._lock:
            await self._resume()

    async def _pause(self, mode: str) -> None:
        """Stop generating until `resume`. Requests that arrive meanwhile are queued, in order.

        "abort": every open request ends now with finish_reason "abort" and the output it has;
        returns once nothing runs and its KV is free. "wait": open requests finish normally;
        returns when the last has. "keep": freezes at the next step boundary with the KV kept;
        `resume` continues them as if nothing happened.
        """
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {', '.join(PAUSE_MODES)}, not {mode!r}")
        if self._paused:
            raise ValueError("the engine is already paused")
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

    async def flush_cache(self) -> None:
        """Drop the prefix cache; ValueError naming the counts while any request is open."""
        await self._calls.control(ops.FlushCache(False))

    async def set_internal_state(self, settings: Mapping[str, Any]) -> None:
        """Change the settings that may change live (LIVE_SETTINGS); ValueError naming any
        other, or a bad value, and then nothing changes."""
        others = sorted(set(settings) - set(LIVE_SETTINGS))
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

    # -- weights ----------------------------------------------------------------------------

    async def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> tuple[bool, str, int]:
        """Serve the weights of another checkpoint of the same model: (success, message,
        requests that were open when the update began). See `_update` for the steps."""
        success, message, num_open = await self._update(
            ops.UpdateWeights(model_path), weight_version, flush_cache, abort_all_requests
        )
        if success:
            self.model_path = model_path
            self._checkpoint_version = self.weight_version
        return success, message, num_open

    async def update_weights_from_tensor(
        self,
        tensors: NamedTensors | Path,
        *,
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> tuple[bool, str]:
        """Install named tensors (some or all of the model's, by checkpoint name): torch
        tensors, or a safetensors file's path. They reach the worker as a safetensors file,
        never pickled."""
        if isinstance(tensors, Path):
            return await self._install_file(str(tensors), weight_version, flush_cache)
        with temporary_file(".safetensors") as path:
            try:
                await trio.to_thread.run_sync(save_safetensors, tensors, path)
            except (TypeError, ValueError, AttributeError) as exc:  # not tensors by name
                return False, f"Failed to update weights: {type(exc).__name__}: {exc}"
            return await self._install_file(path, weight_version, flush_cache)

    async def _install_file(
        self, path: str, weight_version: str | None, flush_cache: bool
    ) -> tuple[bool, str]:
        op = ops.UpdateWeightsFromFile(path)
        success, message, _ = await self._update(op, weight_version, flush_cache)
        return success, message

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str | None = None,
    ) -> tuple[bool, str]:
        """Join a trainer's torch.distributed world (the trainer is rank 0) as `rank_offset`;
        returns once joined. Generation, and other control calls, go on meanwhile: a trainer
        that never comes holds nothing up (the join fails after GROUP_TIMEOUT). With data
        parallelism, group g's worker is rank `rank_offset + g`."""
        problem = group_problem(master_port, rank_offset, world_size, self._workers)
        if problem:
            return False, f"Failed to init the weight update group: {problem}"
        join = ops.JoinWeightGroup(
            group_name, master_address, master_port, rank_offset, world_size, backend or ""
        )
        try:
            await self._calls.control(join)
        except ValueError as exc:
            return False, f"Failed to init the weight update group: {exc}"
        return True, "Succeeded to init the weight update group."

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str,
        *,
        flush_cache: bool = True,
        weight_version: str | None = None,
        abort_all_requests: bool = False,
    ) -> tuple[bool, str]:
        """Receive one broadcast per named tensor from rank 0 of the group, in order, then
        install them all at once (see `_update`).

        Any failure leaves the group, which must be initialized again: the trainer's
        broadcasts are then out of step with ours (a later update would take this one's).
        That includes an update refused, or abandoned by its caller, before the worker heard
        of it.
        """
        problem = announcement_problem(names, dtypes, shapes)
        op = ops.UpdateWeightsFromGroup(
            group_name, tuple(names), tuple(dtypes), tuple([tuple(s) for s in shapes])
        )
        success, answer, delivered = False, f"Failed to update weights: {problem}", False

        def queued() -> None:
            nonlocal delivered
            delivered = True  # the worker will receive, or leave the group itself

        try:
            if not problem:
                success, answer, _ = await self._update(
                    op, weight_version, flush_cache, abort_all_requests, queued
                )
        finally:
            if not delivered:  # the worker will not receive: the trainer's sends are stray
                with trio.CancelScope(shield=True):
                    await self.leave_weights_update_group(group_name)
        if not delivered:
            answer += f" (the weight update group {group_name!r} was left: init it again)"
        return success, answer

    async def leave_weights_update_group(self, group_name: str) -> None:
        """Leave a group if joined; nothing if not (or if the engine is gone)."""
        with contextlib.suppress(ValueError, EngineDeadError):
            await self._calls.control(ops.LeaveWeightGroup(group_name))

    async def destroy_weights_update_group(self, group_name: str) -> tuple[bool, str]:
        async with self._lock:
            try:
                await self._calls.control(ops.LeaveWeightGroup(group_name))
            except ValueError as exc:
                return False, f"Failed to destroy the weight update group: {exc}"
        return True, "Succeeded to destroy the weight update group."

    async def _update(
        self,
        op: ops.ControlOp,
        weight_version: str | None,
        flush_cache: bool,
        abort_all_requests: bool = False,
        queued: Callable[[], None] = lambda: None,
    ) -> tuple[bool, str, int]:
        """Change the weights the worker serves: (success, message, requests that were open
        when the update began); `queued` is called once `op` is on its way.

        Not paused: new requests wait while open ones finish (or are aborted, with
        `abort_all_requests`), the weights change, then everything resumes. Paused: at once.
        The worker checks every tensor before any changes; on a failure the old weights serve
        on. The prefix cache is flushed unless told not to (its KV is the old weights').
        Control calls take turns, and a caller that leaves does not stop an update midway.
        """
        async with self._lock:
            if "weights" in self._released:
                return False, "the weights are released: resume_memory_occupation first", 0
            num_open = len(self._requests)
            with trio.CancelScope(shield=True):
                pausing = not self._paused
                if pausing:
                    await self._pause("abort" if abort_all_requests else "wait")
                try:
                    queued()
                    await self._calls.control(op)
                    self.weight_version = weight_version or self.weight_version
                    if flush_cache:  # before anyone resumes: held requests must not match it
                        await self._calls.control(ops.FlushCache(True))
                except ValueError as exc:
                    return False, f"Failed to update weights: {exc}", num_open
                finally:
                    if pausing:
                        await self._resume()
            return True, "Succeeded to update model weights.", num_open

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[float]:
        """The first `truncate_size` values of a parameter, flattened, as the worker serves
        it (a checkpoint name, e.g. `model.layers.0.self_attn.q_proj.weight`, or ours);
        ValueError if there is no such parameter."""
        if not 1 <= truncate_size <= MAX_WEIGHT_VALUES:
            raise ValueError(f"truncate_size must be in [1, {MAX_WEIGHT_VALUES}]")
        return list(await self._calls.control(ops.GetWeights(name, truncate_size)))

    # -- memory -----------------------------------------------------------------------------

    @property
    def is_sleeping(self) -> bool:
        return bool(self._released)

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Free the KV pool and/or the weights (default both) for a colocated trainer; the
        memory is returned before this returns. Only while no request runs or waits: pause
        first if any do. Generation stays paused (new requests wait) until
        `resume_memory_occupation` has brought everything back."""
        wanted = memory_tags(tags)
        async with self._lock:
            if not self._paused:
                await self._pause("keep")  # holds new requests; nothing in flight after it
                self._paused_to_sleep = True
            try:
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
                await self._calls.control(ops.ResumeMemory(wanted))
                self._released.difference_update(wanted)
                if "weights" in wanted:  # reloaded from model_path: tensor updates are gone
                    self.weight_version = self._checkpoint_version
            if not self._released and self._paused_to_sleep:
                self._paused_to_sleep = False
                await self._resume()

    # -- profiles ---------------------------------------------------------------------------

    @property
    def is_profiling(self) -> bool:
        """A profile runs (one with `num_steps` ends by itself)."""
        request = self._profiling
        return request is not None and (self._trace.on or not request.num_steps)

    async def start_profile(self, output_dir: str, num_steps: int | None = None,
                            activities: Sequence[str] = ("CPU",), record_shapes: bool = False,
                            with_stack: bool = False) -> None:  # fmt: skip
        """Trace every actor's steps into `output_dir` until `stop_profile`, or for
        `num_steps` steps; ValueError if a profile runs or the folder cannot be made."""
        if self.is_profiling:
            raise ValueError("a profile is running: stop_profile first")
        request = profile_request(output_dir, num_steps, activities, record_shapes, with_stack)
        try:
            await trio.Path(output_dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"cannot write profiles to {output_dir}: {exc}") from None
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

    async def stop_profile(self) -> None:
        """Stop profiling; once it returns, every actor's trace file is written."""
        if not self.is_profiling:
            raise ValueError("no profile is running")
        self._profiling = None
        problem = self._trace.stop()
        await self._calls.control(ops.StopProfile())  # ValueError if an actor could not write
        if problem:
            raise ValueError(problem)
