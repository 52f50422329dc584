"""The engine's steering calls, as `EngineClient` names them, each handed to its `Steering`
(runtime/frontend/steering.py), so that the engine's own file stays about requests."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from runtime.frontend.steering import Steering
from runtime.protocol import NamedTensors


class SteeringCalls:
    """The engine's steering calls (EngineClient's), each handed to its `Steering`."""

    steering: Steering
    _check_alive: Callable[[], None]  # the engine's: EngineDeadError if it has stopped

    @property
    def is_paused(self) -> bool:
        return self.steering.is_paused

    async def pause(self, mode: str = "abort") -> None:
        self._check_alive()
        await self.steering.pause(mode)

    async def resume(self) -> None:
        await self.steering.resume()

    async def flush_cache(self) -> None:
        await self.steering.flush_cache()

    async def set_internal_state(self, settings: Mapping[str, Any]) -> None:
        await self.steering.set_internal_state(settings)

    async def update_weights_from_disk(
        self, model_path: str, **options: Any
    ) -> tuple[bool, str, int]:
        return await self.steering.update_weights_from_disk(model_path, **options)

    async def update_weights_from_tensor(
        self, tensors: NamedTensors | Path, **options: Any
    ) -> tuple[bool, str]:
        return await self.steering.update_weights_from_tensor(tensors, **options)

    async def init_weights_update_group(self, *args: Any, **kwargs: Any) -> tuple[bool, str]:
        return await self.steering.init_weights_update_group(*args, **kwargs)

    async def update_weights_from_distributed(self, *args: Any, **kwargs: Any) -> tuple[bool, str]:
        return await self.steering.update_weights_from_distributed(*args, **kwargs)

    async def destroy_weights_update_group(self, group_name: str) -> tuple[bool, str]:
        return await self.steering.destroy_weights_update_group(group_name)

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[float]:
        return await self.steering.get_weights_by_name(name, truncate_size)

    @property
    def is_sleeping(self) -> bool:
        return self.steering.is_sleeping

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        await self.steering.release_memory_occupation(tags)

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        await self.steering.resume_memory_occupation(tags)
