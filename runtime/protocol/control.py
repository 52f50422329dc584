"""The control protocols, what the control routes of `api/` use: `ControlClient` (pause and
resume, cache flush, live settings, memory release, profiles) and `WeightsClient` (weight
updates, reading a parameter, the weights' version)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from runtime.protocol.types import NamedTensors


class ControlClient(Protocol):
    @property
    def is_paused(self) -> bool: ...

    async def pause(self, mode: str = "abort") -> bool:
        """Stop generating until `resume`; requests that arrive meanwhile wait, in order.
        `mode`: "abort" (open requests end now, with their output so far), "wait" (they
        finish first), "keep" (they freeze, KV kept, and continue on resume) or "retract"
        (they freeze, KV freed, and are recomputed on resume). True if this call paused the
        engine, False if it was paused already (nothing changes). ValueError for another
        mode."""
        ...

    async def resume(self) -> None:
        """Continue after `pause`; a no-op if not paused."""
        ...

    async def flush_cache(self, force: bool = False) -> None:
        """Drop the prefix cache. ValueError (naming the counts) while any request is open,
        unless `force` (the running requests keep their KV, but nobody shares it)."""
        ...

    @property
    def is_sleeping(self) -> bool: ...

    async def release_memory_occupation(
        self, tags: list[str] | None = None, *, pause_mode: str = "keep"
    ) -> None:
        """Free the KV pool and/or the weights (tags "kv_cache", "weights"; default both);
        generation waits until `resume_memory_occupation`. If not paused, it pauses in
        `pause_mode` first; ValueError while requests run ("keep" leaves them running)."""
        ...

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None: ...

    async def start_profile(
        self,
        output_dir: str | None = None,
        num_steps: int | None = None,
        activities: Sequence[str] = ("CPU",),
        record_shapes: bool = False,
        with_stack: bool = False,
    ) -> str:
        """Trace every actor's steps (the worker's with torch.profiler) as Chrome trace files
        in `output_dir` (None: a new private folder), until `stop_profile` or for `num_steps`
        steps; returns the folder. ValueError if a profile runs."""
        ...

    async def stop_profile(self) -> None:
        """Stop profiling once every trace is written; ValueError if none runs."""
        ...

    async def set_internal_state(self, settings: Mapping[str, Any]) -> None:
        """Change settings live: only `max_num_seqs` (SGLang: `max_running_requests`);
        ValueError naming any other, or a bad value, and then nothing changes."""
        ...


class WeightsClient(Protocol):
    async def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        keep_pause: bool = False,
    ) -> tuple[bool, str, int]:
        """Serve another checkpoint's weights: (success, message, requests open meanwhile).
        The prefix cache is flushed unless `flush_cache` is False; open requests finish
        first, or end now with `abort_all_requests`."""
        ...

    async def update_weights_from_tensor(
        self,
        tensors: NamedTensors | Path,
        *,
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> tuple[bool, str]:
        """Install named tensors over the served weights (some or all; checkpoint names):
        a mapping or pairs of name and torch tensor, or the path of a safetensors file. As
        `update_weights_from_disk`."""
        ...

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
        `backend` "gloo" or "nccl" (default: nccl on CUDA, gloo on CPU)."""
        ...

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
        """Receive one broadcast per named tensor from the trainer, then install them all as
        `update_weights_from_disk` does."""
        ...

    async def destroy_weights_update_group(self, group_name: str) -> tuple[bool, str]: ...

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[float]:
        """The first values of a parameter (flattened), to check an update; ValueError if the
        model has no such parameter."""
        ...

    async def update_weight_version(
        self, new_version: str, abort_all_requests: bool = True
    ) -> None:
        """Name the served weights; with `abort_all_requests` the open requests end now."""
        ...
