"""Request bodies of the control routes (api/control_api.py, api/operator_api.py): SGLang's
shapes, validated as strictly as the generation routes' (api/schemas.py)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from api.routes.schemas import Strict
from runtime.protocol import MAX_TENSOR_DIM

PauseMode = Literal["abort", "wait", "keep"]


class PauseGenerationRequest(Strict):
    """SGLang's `POST /pause_generation`."""

    mode: PauseMode = "abort"


class ContinueGenerationRequest(Strict):
    """SGLang's `POST /continue_generation` (no fields)."""


class AbortRequest(Strict):
    """SGLang's `POST /abort_request`: one request by its `rid`, or all of them."""

    rid: str = ""
    abort_all: bool = False


MAX_UPDATE_TENSORS = 100_000  # tensors in one update: a 70B Llama has under 1,000


class UpdateWeightsFromDiskRequest(Strict):
    """SGLang's `POST /update_weights_from_disk`."""

    model_path: str
    weight_version: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False


class InitWeightsUpdateGroupRequest(Strict):
    """SGLang's `POST /init_weights_update_group`: join the trainer's torch.distributed world
    (the trainer is rank 0). `backend` defaults to nccl on CUDA and gloo on CPU."""

    master_address: Annotated[str, Field(min_length=1, max_length=255)]
    master_port: Annotated[int, Field(ge=1, le=65535)]
    rank_offset: Annotated[int, Field(ge=1, le=65535)]
    world_size: Annotated[int, Field(ge=2, le=65536)]
    group_name: Annotated[str, Field(min_length=1, max_length=255)] = "weight_update_group"
    backend: Literal["gloo", "nccl"] | None = None

    @model_validator(mode="after")
    def _rank_in_world(self) -> InitWeightsUpdateGroupRequest:
        if self.rank_offset >= self.world_size:
            raise ValueError("rank_offset must be below world_size (the trainer is rank 0)")
        return self


class UpdateWeightsFromDistributedRequest(Strict):
    """SGLang's `POST /update_weights_from_distributed`: one broadcast per tensor, in order."""

    names: Annotated[list[str], Field(min_length=1, max_length=MAX_UPDATE_TENSORS)]
    dtypes: Annotated[list[str], Field(min_length=1, max_length=MAX_UPDATE_TENSORS)]
    shapes: Annotated[
        list[Annotated[list[Annotated[int, Field(ge=0, le=MAX_TENSOR_DIM)]], Field(max_length=8)]],
        Field(min_length=1, max_length=MAX_UPDATE_TENSORS),
    ]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None

    @model_validator(mode="after")
    def _same_lengths(self) -> UpdateWeightsFromDistributedRequest:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError("names, dtypes and shapes must have the same length")
        return self


class DestroyWeightsUpdateGroupRequest(Strict):
    """SGLang's `POST /destroy_weights_update_group`."""

    group_name: str = "weight_update_group"


class SetInternalStateRequest(Strict):
    """SGLang's `POST /set_internal_state`: the settings to change, by name."""

    server_args: Annotated[dict[str, Any], Field(max_length=64)]


class ConfigureLoggingRequest(Strict):
    """SGLang's `POST /configure_logging`: what to change; an empty dump folder stops dumps."""

    log_requests: bool | None = None
    log_requests_level: Annotated[int, Field(ge=0, le=3)] | None = None
    dump_requests_folder: Annotated[str, Field(max_length=4096)] | None = None
    dump_requests_threshold: Annotated[int, Field(ge=1, le=100_000)] | None = None


Activity = Literal["CPU", "GPU"]


class StartProfileRequest(Strict):
    """SGLang's `POST /start_profile`: Chrome traces of every actor into `output_dir`."""

    output_dir: Annotated[str, Field(min_length=1, max_length=4096)]
    num_steps: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    activities: Annotated[list[Activity], Field(min_length=1, max_length=2)] = Field(
        default_factory=lambda: list[Activity](["CPU"])
    )
    record_shapes: bool = False
    with_stack: bool = False


class GetWeightsByNameRequest(Strict):
    """SGLang's `POST /get_weights_by_name`."""

    name: str
    truncate_size: Annotated[int, Field(ge=1, le=100_000)] = 100


MemoryTag = Literal["kv_cache", "weights"]


class MemoryOccupationRequest(Strict):
    """SGLang's `POST /release_memory_occupation` and `/resume_memory_occupation`."""

    tags: Annotated[list[MemoryTag], Field(min_length=1, max_length=2)] | None = None
