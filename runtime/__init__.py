"""The engine: `open_engine(EngineConfig(...))` and `Engine.generate(prompt, SamplingParams(...))`.

Imports are lazy so that actor processes (the scheduler) load only what they use: no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime.config.constraint import Constraint
    from runtime.config.engine import EngineConfig
    from runtime.config.sampling import SamplingParams
    from runtime.frontend.engine import Engine
    from runtime.frontend.launch import open_engine
    from runtime.protocol import RequestOutput

__all__ = ["Constraint", "Engine", "EngineConfig", "RequestOutput", "SamplingParams", "open_engine"]

_WHERE = {
    "Constraint": "runtime.config.constraint",
    "Engine": "runtime.frontend.engine",
    "open_engine": "runtime.frontend.launch",
    "EngineConfig": "runtime.config.engine",
    "RequestOutput": "runtime.protocol",
    "SamplingParams": "runtime.config.sampling",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'runtime' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_WHERE[name]), name)
