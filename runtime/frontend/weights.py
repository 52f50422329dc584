"""The engine's weights part (`engine.weights`, a `WeightsClient`): updates from a checkpoint,
from tensors, from a trainer's torch.distributed group; reading a parameter; the version.

Every update takes the control part's exclusive turn (runtime/frontend/control.py): not
paused, new requests wait while the open ones finish (or are aborted), the weights change,
then everything resumes. The worker checks every tensor before any changes; on a failure the
old weights serve on. The prefix cache is flushed unless told not to (its KV is the old
weights').
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from pathlib import Path

import trio

from runtime.frontend.calls import Calls
from runtime.frontend.control import EngineControl
from runtime.frontend.open_requests import OpenRequests
from runtime.frontend.weight_sources import (
    ServedVersion,
    announcement_problem,
    group_problem,
    save_safetensors,
    temporary_file,
)
from runtime.protocol import EngineDeadError, NamedTensors
from runtime.wire import control as ops

MAX_WEIGHT_VALUES = 100_000  # what get_weights_by_name may return: a check, not a download


def op_name(op: ops.ControlOp) -> str:
    """How a health check names a weight update under way."""
    return {
        ops.UpdateWeights: "update_weights_from_disk",
        ops.UpdateWeightsFromFile: "update_weights_from_tensor",
        ops.UpdateWeightsFromGroup: "update_weights_from_distributed",
    }.get(type(op), type(op).__name__)


class WeightUpdates:
    def __init__(
        self,
        calls: Calls,
        control: EngineControl,
        requests: OpenRequests,
        served: ServedVersion,
        data_parallel_size: int = 1,
    ) -> None:
        self._calls = calls
        self._control = control
        self._requests = requests
        self.served = served
        self._workers = data_parallel_size  # each a rank of a trainer's weight group

    async def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        keep_pause: bool = False,
    ) -> tuple[bool, str, int]:
        """Serve the weights of another checkpoint of the same model: (success, message,
        requests that were open when the update began). `keep_pause`: stay paused after."""
        op = ops.UpdateWeights(model_path)
        success, message, num_open = await self._update(
            op, weight_version, flush_cache, abort_all_requests, keep_pause
        )
        if success:
            self.served.loaded(model_path, weight_version)
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
        install them all at once.

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
                    op, weight_version, flush_cache, abort_all_requests, queued=queued
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
        keep_pause: bool = False,
        queued: Callable[[], None] = lambda: None,
    ) -> tuple[bool, str, int]:
        """Change the weights the worker serves in the control part's exclusive turn:
        (success, message, requests that were open when the update began); `queued` is
        called once `op` is on its way."""
        num_open = 0
        try:
            async with self._control.exclusive(
                op_name(op), abort_open=abort_all_requests, keep_pause=keep_pause
            ) as num_open:
                queued()
                await self._calls.control(op)
                self.served.weight_version = weight_version or self.served.weight_version
                if flush_cache:  # before anyone resumes: held requests must not match it
                    await self._calls.control(ops.FlushCache(True))
        except ValueError as exc:
            return False, f"Failed to update weights: {exc}", num_open
        return True, "Succeeded to update model weights.", num_open

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[float]:
        """The first `truncate_size` values of a parameter, flattened, as the worker serves
        it (a checkpoint name, e.g. `model.layers.0.self_attn.q_proj.weight`, or ours);
        ValueError if there is no such parameter."""
        if not 1 <= truncate_size <= MAX_WEIGHT_VALUES:
            raise ValueError(f"truncate_size must be in [1, {MAX_WEIGHT_VALUES}]")
        return list(await self._calls.control(ops.GetWeights(name, truncate_size)))

    async def update_weight_version(
        self, new_version: str, abort_all_requests: bool = True
    ) -> None:
        """Name the served weights (SGLang's: what runs was made by older ones, so by default
        the open requests end now, with what they have)."""
        if abort_all_requests:
            self._requests.abort_all()
        self.served.weight_version = new_version
