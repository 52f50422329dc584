"""The engine-facing protocol: all that `api/` may import from `runtime` (a test enforces it),
so its tests drive it with small fakes, and another engine could stand in.

`EngineClient` is the request protocol (generate, text, sessions, statistics, health);
`ControlClient` (`EngineClient.control`: pause, memory, profiles) and `WeightsClient`
(`EngineClient.weights`: updates, reads, version) the control protocols. The frontend
(`runtime.frontend.engine.Engine`) implements them.
"""

from runtime.config.constraint import Constraint, check_depth, close_objects
from runtime.config.errors import FieldError
from runtime.config.pooling import POOLING_TYPES, PoolingParams
from runtime.config.sampling import SamplingParams
from runtime.protocol.control import ControlClient, WeightsClient
from runtime.protocol.engine import EngineClient
from runtime.protocol.types import (
    MAX_TENSOR_DIM,
    Embedding,
    EngineDeadError,
    EngineStats,
    FrontendStats,
    ModelCard,
    NamedTensors,
    PromptLogprob,
    RankStats,
    RequestAbortedError,
    RequestOutput,
    RequestTimeoutError,
    SchedulerStats,
    SessionParams,
    TopLogprobs,
    WorkerStats,
)

__all__ = [
    "MAX_TENSOR_DIM",
    "POOLING_TYPES",
    "Constraint",
    "ControlClient",
    "Embedding",
    "EngineClient",
    "EngineDeadError",
    "EngineStats",
    "FieldError",
    "FrontendStats",
    "ModelCard",
    "NamedTensors",
    "PoolingParams",
    "PromptLogprob",
    "RankStats",
    "RequestAbortedError",
    "RequestOutput",
    "RequestTimeoutError",
    "SamplingParams",
    "SchedulerStats",
    "SessionParams",
    "TopLogprobs",
    "WeightsClient",
    "WorkerStats",
    "check_depth",
    "close_objects",
]
