"""Steering a live engine: pause and resume, cache flush, weight updates, memory release.

What a reinforcement-learning loop does between rollouts (generate, pause, load the trainer's
weights, flush stale KV, resume), built on the engine's control messages, which the actors
answer in order with everything else the engine sent.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import trio

from runtime.frontend.weight_sources import (
    announcement_problem,
    save_safetensors,
    temporary_file,
)
from runtime.protocol import EngineDeadError, EngineStats, NamedTensors
from runtime.wire.messages import (
    Configure,
    FlushCache,
    GetWeights,
    JoinWeightGroup,
    LeaveWeightGroup,
    Pause,
    ReleaseMemory,
    Resume,
    ResumeMemory,
    UpdateWeights,
    UpdateWeightsFromFile,
    UpdateWeightsFromGroup,
    WeightValues,
)

PAUSE_MODES = ("abort", "wait", "keep")
MEMORY_TAGS = ("kv_cache", "weights")
# What set_internal_state may change; SGLang calls max_num_seqs max_running_requests.
LIVE_SETTINGS = ("max_num_seqs", "max_running_requests")
MAX_WEIGHT_VALUES = 100_000  # what get_weights_by_name may return: a check, not a download


class Controlled(Protocol):
    """What steering needs of the engine."""

    def abort_all(self) -> None: ...

    def statistics(self) -> EngineStats: ...

    async def control(self, make: Callable[[int], object]) -> None:
        """Send a control message (made from its nonce); ValueError if it failed."""
        ...

    async def ask(self, make: Callable[[int], object]) -> object:
        """Send a message (made from its nonce) and return the actors' answer."""
        ...


class Steering:
    def __init__(self, engine: Controlled, model_path: str, data_parallel_size: int = 1) -> None:
        self._engine = engine
        self._workers = data_parallel_size  # each a rank of a trainer's weight group
        self._paused = False
        # Steering calls run one after another, so none sees another's half-done state (a
        # resume slipping into a memory release, a user's pause into an update).
        self._lock = trio.Lock()
        self.model_path = model_path
        self.weight_version = "default"  # as SGLang names the weights a server started with
        self._checkpoint_version = self.weight_version  # that of the weights at model_path
        self._released: set[str] = set()  # memory given back (release_memory_occupation)
        self._paused_to_sleep = False  # the release paused generation: the resume unpauses

    @property
    def is_paused(self) -> bool:
        return self._paused

    async def pause(self, mode: str = "abort") -> None:
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
            self._engine.abort_all()  # leaves before the pause: their KV is freed first
        await self._engine.control(lambda nonce: Pause(nonce, "keep" if mode == "abort" else mode))

    async def _resume(self) -> None:
        """Continue after `pause` (a no-op if not paused)."""
        if self._released:
            raise ValueError(
                f"the engine's {' and '.join(sorted(self._released))} memory is released: "
                "resume_memory_occupation first"
            )
        if self._paused:
            await self._engine.control(Resume)
            self._paused = False

    async def flush_cache(self) -> None:
        """Drop the prefix cache; ValueError naming the counts while any request is open."""
        await self._engine.control(lambda nonce: FlushCache(nonce, False))

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
                await self._engine.control(lambda nonce: Configure(nonce, value))

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
            lambda nonce: UpdateWeights(nonce, model_path),
            weight_version=weight_version,
            flush_cache=flush_cache,
            abort_all_requests=abort_all_requests,
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
            return await self.update_weights_from_file(
                str(tensors), weight_version=weight_version, flush_cache=flush_cache
            )
        with temporary_file(".safetensors") as path:
            try:
                await trio.to_thread.run_sync(save_safetensors, tensors, path)
            except (TypeError, ValueError, AttributeError) as exc:  # not tensors by name
                return False, f"Failed to update weights: {type(exc).__name__}: {exc}"
            return await self.update_weights_from_file(
                path, weight_version=weight_version, flush_cache=flush_cache
            )

    async def update_weights_from_file(
        self, path: str, *, weight_version: str | None = None, flush_cache: bool = True
    ) -> tuple[bool, str]:
        """Install the tensors of a safetensors file (some or all of the model's, by
        checkpoint name): update_weights_from_tensor's worker side."""
        success, message, _ = await self._update(
            lambda nonce: UpdateWeightsFromFile(nonce, path),
            weight_version=weight_version,
            flush_cache=flush_cache,
        )
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
        returns once joined. Generation, and other steering calls, go on meanwhile: a
        trainer that never comes holds nothing up (the join fails after GROUP_TIMEOUT).
        With data parallelism, group g's worker is rank `rank_offset + g`."""
        last = rank_offset + self._workers - 1
        if not (1 <= master_port <= 65535 and 1 <= rank_offset <= last < world_size <= 65536):
            return False, (
                "Failed to init the weight update group: need 1 <= master_port <= 65535 and "
                "1 <= rank_offset, rank_offset + data_parallel_size - 1 < world_size <= "
                f"65536, got {master_port}, {rank_offset}, {world_size}"
            )
        join = lambda nonce: JoinWeightGroup(  # noqa: E731
            nonce, group_name, master_address, master_port, rank_offset, world_size, backend or ""
        )
        try:
            await self._engine.control(join)
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
        delivered = False

        def message(nonce: int) -> UpdateWeightsFromGroup:
            nonlocal delivered
            delivered = True  # queued: the worker will receive, or leave the group itself
            return UpdateWeightsFromGroup(
                nonce,
                group_name,
                tuple(names),
                tuple(dtypes),
                tuple([tuple(shape) for shape in shapes]),
            )

        success, answer = False, f"Failed to update weights: {problem}"
        try:
            if not problem:
                success, answer, _ = await self._update(
                    message,
                    weight_version=weight_version,
                    flush_cache=flush_cache,
                    abort_all_requests=abort_all_requests,
                )
        finally:
            if not delivered:
                with trio.CancelScope(shield=True):
                    await self.leave_weights_update_group(group_name)
        if not delivered:
            answer += f" (the weight update group {group_name!r} was left: init it again)"
        return success, answer

    async def leave_weights_update_group(self, group_name: str) -> None:
        """Leave a group if joined; nothing if not (or if the engine is gone)."""
        with contextlib.suppress(ValueError, EngineDeadError):
            await self._engine.control(lambda nonce: LeaveWeightGroup(nonce, group_name))

    async def destroy_weights_update_group(self, group_name: str) -> tuple[bool, str]:
        async with self._lock:
            try:
                await self._engine.control(lambda nonce: LeaveWeightGroup(nonce, group_name))
            except ValueError as exc:
                return False, f"Failed to destroy the weight update group: {exc}"
        return True, "Succeeded to destroy the weight update group."

    async def _update(
        self,
        make: Callable[[int], object],
        *,
        weight_version: str | None,
        flush_cache: bool,
        abort_all_requests: bool = False,
    ) -> tuple[bool, str, int]:
        """Change the weights the worker serves: (success, message, requests that were open
        when the update began).

        Not paused: new requests wait while open ones finish (or are aborted, with
        `abort_all_requests`), the weights change, then everything resumes. Paused: at once.
        The worker checks every tensor before any changes; on a failure the old weights serve
        on. The prefix cache is flushed unless told not to (its KV is the old weights').
        Steering calls run one after another, and a caller that leaves does not stop an
        update midway.
        """
        async with self._lock:
            if "weights" in self._released:
                return False, "the weights are released: resume_memory_occupation first", 0
            num_open = self._engine.statistics().frontend.num_requests_open
            with trio.CancelScope(shield=True):
                pausing = not self._paused
                if pausing:
                    await self._pause("abort" if abort_all_requests else "wait")
                try:
                    await self._engine.control(make)
                    self.weight_version = weight_version or self.weight_version
                    if flush_cache:  # before anyone resumes: held requests must not match it
                        await self._engine.control(lambda nonce: FlushCache(nonce, True))
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
        answer = await self._engine.ask(lambda nonce: GetWeights(nonce, name, truncate_size))
        assert isinstance(answer, WeightValues)
        if answer.error:
            raise ValueError(answer.error)
        return list(answer.values)

    # -- memory ------------------------------------------------------------------------

    @property
    def is_sleeping(self) -> bool:
        return bool(self._released)

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Free the KV pool and/or the weights (default both) for a colocated trainer; the
        memory is returned before this returns. Only while no request runs or waits: pause
        first if any do. Generation stays paused (new requests wait) until
        `resume_memory_occupation` has brought everything back."""
        wanted = _memory_tags(tags)
        async with self._lock:
            if not self._paused:
                await self._pause("keep")  # holds new requests; nothing in flight after it
                self._paused_to_sleep = True
            try:
                await self._engine.control(lambda nonce: ReleaseMemory(nonce, wanted))
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
            wanted = tuple(t for t in _memory_tags(tags) if t in self._released)
            if wanted:
                await self._engine.control(lambda nonce: ResumeMemory(nonce, wanted))
                self._released.difference_update(wanted)
                if "weights" in wanted:  # reloaded from model_path: tensor updates are gone
                    self.weight_version = self._checkpoint_version
            if not self._released and self._paused_to_sleep:
                self._paused_to_sleep = False
                await self._resume()


def _memory_tags(tags: list[str] | None) -> tuple[str, ...]:
    if tags is None:
        return MEMORY_TAGS
    unknown = sorted(set(tags) - set(MEMORY_TAGS))
    if unknown or not tags:
        raise ValueError(f"tags must be among {', '.join(MEMORY_TAGS)}, got {tags!r}")
    return tuple(t for t in MEMORY_TAGS if t in tags)
