"""Request bodies and query parameters of the control routes (api/routes/control.py,
weights.py, operator.py): SGLang's bodies and vLLM's query parameters, under the field policy
of api/http/fields.py. Numbers SGLang's models coerce from strings are coerced here too
(AReaL sends `master_port` as a string)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from api.http.fields import Body, LaxBool, LaxInt, Refusal, refusals
from api.routes.sampling_fields import Name, PathText, Rid
from runtime.protocol import MAX_TENSOR_DIM

# SGLang's modes, and vLLM's "wait" and "keep" ("in_place" is SGLang's "keep")
PauseMode = Literal["abort", "retract", "in_place", "wait", "keep"]
VLLMPauseMode = Literal["abort", "wait", "keep"]
Version = Annotated[str, Field(min_length=1, max_length=256)]
LaxFloat = Annotated[float, Field(strict=False)]


class PauseGenerationRequest(Body):
    """SGLang's `POST /pause_generation`."""

    mode: PauseMode = "abort"


class ContinueGenerationRequest(Body):
    """SGLang's `POST /continue_generation` (no fields)."""


class AbortRequest(Body):
    """SGLang's `POST /abort_request`: one request by its `rid`, or all of them."""

    no_ops = frozenset({"finished_reason", "abort_message"})
    rid: Annotated[str, Field(max_length=256)] = ""
    abort_all: bool = False


class AbortRequestsRequest(Body):
    """vLLM's `POST /abort_requests`: these requests, or all if none is named."""

    request_ids: Annotated[list[Rid], Field(max_length=4096)] = Field(default_factory=list)


MAX_UPDATE_TENSORS = 100_000  # tensors in one update: a 70B Llama has under 1,000
AUTO_FORMAT = Refusal(("auto",), "only the checkpoint's own format is loaded")


class UpdateWeightsFromDiskRequest(Body):
    """SGLang's `POST /update_weights_from_disk`."""

    # CUDA graphs are always recaptured after an update; nothing is cached to empty
    no_ops = frozenset({"torch_empty_cache", "recapture_cuda_graph", "token_step"})
    refused_unless = refusals(
        load_format=AUTO_FORMAT,
        is_async=Refusal((False,), "updates are applied before the call returns"),
        manifest=Refusal(({},), "checkpoint manifests are not supported"),
    )
    model_path: PathText
    weight_version: Version | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    keep_pause: bool = False  # stay paused after the update, even if it paused for it


class InitWeightsUpdateGroupRequest(Body):
    """SGLang's `POST /init_weights_update_group`: join the trainer's torch.distributed world
    (the trainer is rank 0). `backend` defaults to nccl on CUDA and gloo on CPU."""

    master_address: Annotated[str, Field(min_length=1, max_length=255)]
    master_port: Annotated[LaxInt, Field(ge=1, le=65535)]
    rank_offset: Annotated[LaxInt, Field(ge=1, le=65535)]
    world_size: Annotated[LaxInt, Field(ge=2, le=65536)]
    group_name: Annotated[str, Field(min_length=1, max_length=255)] = "weight_update_group"
    backend: Literal["gloo", "nccl"] | None = None

    @model_validator(mode="after")
    def _rank_in_world(self) -> InitWeightsUpdateGroupRequest:
        if self.rank_offset >= self.world_size:
            raise ValueError("rank_offset must be below world_size (the trainer is rank 0)")
        return self


class UpdateWeightsFromDistributedRequest(Body):
    """SGLang's `POST /update_weights_from_distributed`: one broadcast per tensor, in order."""

    refused_unless = refusals(load_format=AUTO_FORMAT)
    names: Annotated[list[Name], Field(min_length=1, max_length=MAX_UPDATE_TENSORS)]
    dtypes: Annotated[list[str], Field(min_length=1, max_length=MAX_UPDATE_TENSORS)]
    shapes: Annotated[
        list[Annotated[list[Annotated[int, Field(ge=0, le=MAX_TENSOR_DIM)]], Field(max_length=8)]],
        Field(min_length=1, max_length=MAX_UPDATE_TENSORS),
    ]
    group_name: Annotated[str, Field(min_length=1, max_length=255)] = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Version | None = None

    @model_validator(mode="after")
    def _same_lengths(self) -> UpdateWeightsFromDistributedRequest:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError("names, dtypes and shapes must have the same length")
        return self


class DestroyWeightsUpdateGroupRequest(Body):
    """SGLang's `POST /destroy_weights_update_group`."""

    group_name: Annotated[str, Field(min_length=1, max_length=255)] = "weight_update_group"


class UpdateWeightVersionRequest(Body):
    """SGLang's and vLLM's `POST /update_weight_version`: name the served weights."""

    new_version: Version
    abort_all_requests: bool = True  # SGLang's default: what runs was made by older weights


class SetInternalStateRequest(Body):
    """SGLang's `POST /set_internal_state`: the settings to change, by name."""

    server_args: Annotated[dict[str, Any], Field(max_length=64)]


class ConfigureLoggingRequest(Body):
    """SGLang's `POST /configure_logging`: what to change; an empty dump folder stops dumps."""

    log_requests: bool | None = None
    log_requests_level: Annotated[int, Field(ge=0, le=3)] | None = None
    dump_requests_folder: Annotated[str, Field(max_length=4096)] | None = None
    dump_requests_threshold: Annotated[int, Field(ge=1, le=100_000)] | None = None


Activity = Literal["CPU", "GPU"]


class StartProfileRequest(Body):
    """SGLang's `POST /start_profile`: Chrome traces of every actor into `output_dir` (a new
    private folder if none is given)."""

    no_ops = frozenset({"merge_profiles", "profile_prefix"})  # one file per actor anyway
    refused_unless = refusals(
        start_step=Refusal((), "profiles start at once; stop them with num_steps"),
        profile_by_stage=Refusal((False,), "profiles are of whole steps"),
        profile_stages=Refusal(([],), "profiles are of whole steps"),
    )
    output_dir: Annotated[str, Field(min_length=1, max_length=4096)] | None = None
    num_steps: Annotated[LaxInt, Field(ge=1, le=1_000_000)] | None = None
    activities: Annotated[list[Activity], Field(min_length=1, max_length=2)] = Field(
        default_factory=lambda: list[Activity](["CPU"])
    )
    record_shapes: bool = False
    with_stack: bool = False


class GetWeightsByNameRequest(Body):
    """SGLang's `POST /get_weights_by_name`."""

    name: Name
    truncate_size: Annotated[LaxInt, Field(ge=1, le=100_000)] = 100


# SGLang's tags; "cuda_graph" needs no action of its own here: the decode graphs go with the
# weights or the KV pool they were recorded on, and come back with them
MemoryTag = Literal["kv_cache", "weights", "cuda_graph"]


class MemoryOccupationRequest(Body):
    """SGLang's `POST /release_memory_occupation` and `/resume_memory_occupation`."""

    tags: Annotated[list[MemoryTag], Field(min_length=1, max_length=3)] | None = None


# -- vLLM's query parameters ---------------------------------------------------------------


class PauseQuery(Body):
    """vLLM's `POST /pause?mode=&clear_cache=`."""

    mode: VLLMPauseMode | None = None
    clear_cache: LaxBool = True  # once paused in mode abort or wait, drop the prefix cache
    wait_for_inflight_requests: LaxBool = False  # older vLLM's spelling of mode=wait


class SleepQuery(Body):
    """vLLM's `POST /sleep?level=&mode=`: level 1 frees the KV cache (the weights stay where
    they are, so they come back exactly as they were), level 2 frees the weights too (they are
    reloaded from their checkpoint on wake-up)."""

    no_ops = frozenset({"reset_connector"})  # there is no KV connector
    level: Annotated[LaxInt, Field(ge=1, le=2)] = 1
    mode: VLLMPauseMode = "abort"


class WakeUpQuery(Body):
    """vLLM's `POST /wake_up?tags=weights&tags=kv_cache` (none: everything)."""

    tags: MemoryTag | list[MemoryTag] | None = None


class ResetPrefixCacheQuery(Body):
    """vLLM's `POST /reset_prefix_cache`."""

    reset_running_requests: LaxBool = False  # flush even while requests run (their KV stays)
    reset_external: LaxBool = False  # there is no external KV cache: nothing more to reset


class FlushCacheQuery(Body):
    """SGLang's `/flush_cache?timeout=`: seconds to wait for the requests to end first."""

    timeout: Annotated[LaxFloat, Field(ge=0.0, le=3600.0)] = 0.0


class TensorUploadQuery(Body):
    """`/update_weights_from_tensor`'s options, as query parameters (the body is the file)."""

    weight_version: Version | None = None
    flush_cache: LaxBool = True
