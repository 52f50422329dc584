"""The engine-facing protocol: all that `api/` may import from `runtime` (a test enforces it),
so its tests drive it with small fakes, and another engine could stand in.

`EngineClient` is the request protocol (generate, text, sessions, statistics, health);
`ControlClient` (`EngineClient.control`) the control protocol (pause, weights, memory,
profiles). The frontend (`runtime.frontend.engine.Engine`) implements both.
"""

from runtime.config.sampling import SamplingParams
from runtime.protocol.control import ControlClient
from runtime.protocol.engine import EngineClient
from runtime.protocol.types import (
    MAX_TENSOR_DIM,
    EngineDeadError,
    EngineStats,
    FrontendStats,
    ModelCard,
    NamedTensors,
    PromptLogprob,
    RankStats,
    RequestOutput,
    RequestTimeoutError,
    SchedulerStats,
    SessionParams,
    TopLogprobs,
    WorkerStats,
)

__all__ = [
    "MAX_TENSOR_DIM",
    "ControlClient",
    "EngineClient",
    "EngineDeadError",
    "EngineStats",
    "FrontendStats",
    "ModelCard",
    "NamedTensors",
    "PromptLogprob",
    "RankStats",
    "RequestOutput",
    "RequestTimeoutError",
    "SamplingParams",
    "SchedulerStats",
    "SessionParams",
    "TopLogprobs",
    "WorkerStats",
]
