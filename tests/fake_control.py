"""The fake engine's control part (`FakeEngine.control` and `.weights`): records what it was
asked, and answers as the real one does."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from runtime.protocol import ControlClient, NamedTensors, WeightsClient

if TYPE_CHECKING:
    from tests.fake_engine import FakeEngine


@dataclass
class FakeControl(ControlClient, WeightsClient):
    """The fake engine's control part: records what it was asked."""

    engine: FakeEngine
    paused: str | None = None  # the pause mode, while paused (nothing else changes)
    flushes: int = 0
    released: set[str] = field(default_factory=set)
    updates: list[tuple[str, dict[str, object]]] = field(default_factory=list)
    max_num_seqs: int = 8
    profiling: str | None = None
    weight_version: str = "default"

    @property
    def is_paused(self) -> bool:
        return self.paused is not None

    async def pause(self, mode: str = "abort") -> bool:
        await trio.lowlevel.checkpoint()
        if mode not in ("abort", "wait", "keep", "retract"):
            raise ValueError(f"mode must be one of abort, wait, keep, retract, not {mode!r}")
        if self.paused is not None:
            return False
        self.paused = mode
        return True

    async def resume(self) -> None:
        await trio.lowlevel.checkpoint()
        if self.released:
            raise ValueError("memory is released: resume_memory_occupation first")
        self.paused = None

    async def update_weights_from_disk(
        self, model_path: str, **options: object
    ) -> tuple[bool, str, int]:
        await trio.lowlevel.checkpoint()
        self.updates.append((model_path, options))
        if "bad" in model_path:
            return False, f"Failed to update weights: no checkpoint at {model_path}", 0
        return True, "Succeeded to update model weights.", len(self.engine.open)

    async def update_weights_from_tensor(
        self, tensors: NamedTensors | Path, **options: object
    ) -> tuple[bool, str]:
        await trio.lowlevel.checkpoint()
        assert isinstance(tensors, Path)  # the route streams the body to a file
        body = await trio.Path(tensors).read_bytes()
        self.updates.append((f"tensor:{len(body)} bytes", options))
        if b'"bad"' in body:
            return False, "Failed to update weights: not a readable safetensors file"
        return True, "Succeeded to update model weights."

    async def init_weights_update_group(self, *args: object, **kwargs: object) -> tuple[bool, str]:
        await trio.lowlevel.checkpoint()
        self.updates.append(("init", {"args": args}))
        return True, "Succeeded to init the weight update group."

    async def update_weights_from_distributed(
        self, *args: object, **options: object
    ) -> tuple[bool, str]:
        await trio.lowlevel.checkpoint()
        self.updates.append(("distributed", {"args": args, **options}))
        return True, "Succeeded to update model weights."

    async def destroy_weights_update_group(self, group_name: str) -> tuple[bool, str]:
        await trio.lowlevel.checkpoint()
        self.updates.append(("destroy", {"group_name": group_name}))
        return False, f"no weight update group named {group_name!r}"

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[float]:
        await trio.lowlevel.checkpoint()
        if name != "w":
            raise ValueError(f"the model has no parameter {name!r}")
        return [0.5] * min(truncate_size, 3)

    @property
    def is_sleeping(self) -> bool:
        return bool(self.released)

    async def release_memory_occupation(
        self, tags: list[str] | None = None, *, pause_mode: str = "keep"
    ) -> None:
        await trio.lowlevel.checkpoint()
        if self.engine.open:
            raise ValueError("cannot release memory while requests run")
        self.released |= set(tags or ("kv_cache", "weights"))

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        await trio.lowlevel.checkpoint()
        self.released -= set(tags or ("kv_cache", "weights"))

    async def flush_cache(self, force: bool = False) -> None:
        await trio.lowlevel.checkpoint()
        if self.engine.open and not force:
            raise ValueError(
                f"cannot flush the cache while requests are open: {len(self.engine.open)}"
            )
        self.flushes += 1

    async def start_profile(
        self, output_dir: str | None = None, *args: object, **kwargs: object
    ) -> str:
        await trio.lowlevel.checkpoint()
        if self.profiling is not None:
            raise ValueError("a profile is running: stop_profile first")
        self.profiling = output_dir or "/tmp/fake-profile"
        return self.profiling

    async def stop_profile(self) -> None:
        await trio.lowlevel.checkpoint()
        if self.profiling is None:
            raise ValueError("no profile is running")
        self.profiling = None

    async def set_internal_state(self, settings: Mapping[str, Any]) -> None:
        await trio.lowlevel.checkpoint()
        if set(settings) - {"max_num_seqs", "max_running_requests"}:
            raise ValueError(f"cannot change {', '.join(sorted(settings))} while serving")
        value = settings.get("max_num_seqs", settings.get("max_running_requests"))
        if value is not None:  # as the real engine: naming nothing changes nothing
            self.max_num_seqs = value

    async def update_weight_version(
        self, new_version: str, abort_all_requests: bool = True
    ) -> None:
        await trio.lowlevel.checkpoint()
        self.updates.append(("version", {"new_version": new_version}))
        self.weight_version = new_version
