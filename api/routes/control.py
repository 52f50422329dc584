"""Routes that steer the engine: SGLang's shapes, and vLLM's aliases for the same calls.

They can stop generation for everyone, so they exist only when the server is started with
`--enable-control-api`; without it each answers 404 saying so. Like every route but the public
probes, they require the API key when one is set.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import get_args

import trio
from pydantic import BaseModel
from quart import Response, jsonify, request
from quart_trio import QuartTrio

from api.http.errors import APIError
from api.http.state import ServerState
from api.http.uploads import body_in_file
from api.routes.control_schemas import (
    AbortRequest,
    ConfigureLoggingRequest,
    ContinueGenerationRequest,
    DestroyWeightsUpdateGroupRequest,
    GetWeightsByNameRequest,
    InitWeightsUpdateGroupRequest,
    MemoryOccupationRequest,
    MemoryTag,
    PauseGenerationRequest,
    PauseMode,
    SetInternalStateRequest,
    StartProfileRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
)

Handler = Callable[[], Awaitable[Response]]


def register(app: QuartTrio, state: ServerState) -> None:
    uploading = trio.Lock()  # one weights upload at a time

    def control(rule: str, method: str = "POST") -> Callable[[Handler], Handler]:
        def wrap(handler: Handler) -> Handler:
            async def guarded() -> Response:
                if not state.settings.enable_control_api:
                    raise APIError(
                        404,
                        f"{rule} is off: start the server with --enable-control-api",
                        code="control_api_disabled",
                    )
                return await handler()

            guarded.__name__ = handler.__name__
            app.add_url_rule(rule, view_func=guarded, methods=[method])
            return handler

        return wrap

    @control("/pause_generation")
    async def pause_generation() -> Response:
        req = await state.parse(PauseGenerationRequest, optional=True)
        await pause(state, req.mode)
        return jsonify({"message": "Generation paused successfully.", "status": "ok"})

    @control("/continue_generation")
    async def continue_generation() -> Response:
        await state.parse(ContinueGenerationRequest, optional=True)
        await steer(state.control.resume())
        return jsonify({"message": "Generation continued successfully.", "status": "ok"})

    @control("/pause")
    async def pause_vllm() -> Response:
        mode = request.args.get("mode", "abort")
        if mode not in get_args(PauseMode):
            raise APIError(
                400,
                f"mode must be one of {', '.join(get_args(PauseMode))}, not {mode!r}",
                param="mode",
                code="invalid_value",
            )
        await pause(state, mode)
        return jsonify({"status": "paused"})

    @control("/resume")
    async def resume_vllm() -> Response:
        await steer(state.control.resume())
        return jsonify({"status": "resumed"})

    @control("/is_paused", method="GET")
    async def is_paused() -> Response:
        return jsonify({"is_paused": state.control.is_paused})

    @control("/flush_cache")
    async def flush_cache() -> Response:
        await flush(state)
        return jsonify({"success": True, "message": "Cache flushed."})

    @control("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        await flush(state)
        return Response(b"", 200)

    @control("/update_weights_from_disk")
    async def update_weights_from_disk() -> Response:
        req = await state.parse(UpdateWeightsFromDiskRequest)
        success, message, num_paused = await state.control.update_weights_from_disk(
            req.model_path,
            weight_version=req.weight_version,
            flush_cache=req.flush_cache,
            abort_all_requests=req.abort_all_requests,
        )
        answer = {"success": success, "message": message, "num_paused_requests": num_paused}
        response = jsonify(answer)
        response.status_code = 200 if success else 400
        return response

    @control("/update_weights_from_tensor")
    async def update_weights_from_tensor() -> Response:
        if request.mimetype == "application/json":
            raise APIError(
                400,
                "the body must be a safetensors file (application/octet-stream); pickled "
                "tensors in JSON are not accepted",
                code="invalid_body",
            )
        flush_cache = query_flag("flush_cache", default=True)
        async with body_in_file(".safetensors", uploading) as path:
            success, message = await state.control.update_weights_from_tensor(
                Path(path),
                weight_version=request.args.get("weight_version"),
                flush_cache=flush_cache,
            )
        return answer(success, message)

    @control("/init_weights_update_group")
    async def init_weights_update_group() -> Response:
        req = await state.parse(InitWeightsUpdateGroupRequest)
        success, message = await state.control.init_weights_update_group(
            req.master_address,
            req.master_port,
            req.rank_offset,
            req.world_size,
            req.group_name,
            req.backend,
        )
        return answer(success, message)

    @control("/update_weights_from_distributed")
    async def update_weights_from_distributed() -> Response:
        try:
            req = await state.parse(UpdateWeightsFromDistributedRequest)
        except APIError as error:  # the trainer broadcasts anyway: out of step, so leave
            name = await group_named_in_body()
            await state.control.destroy_weights_update_group(name)
            error.message += f" (the weight update group {name!r} was left: init it again)"
            raise
        success, message = await state.control.update_weights_from_distributed(
            req.names,
            req.dtypes,
            req.shapes,
            req.group_name,
            flush_cache=req.flush_cache,
            weight_version=req.weight_version,
            abort_all_requests=req.abort_all_requests,
        )
        return answer(success, message)

    @control("/destroy_weights_update_group")
    async def destroy_weights_update_group() -> Response:
        req = await state.parse(DestroyWeightsUpdateGroupRequest, optional=True)
        return answer(*await state.control.destroy_weights_update_group(req.group_name))

    @control("/get_weights_by_name")
    async def get_weights_by_name() -> Response:
        req = await state.parse(GetWeightsByNameRequest)
        try:
            values = await state.control.get_weights_by_name(req.name, req.truncate_size)
        except ValueError as exc:
            raise APIError(404, str(exc), param="name", code="not_found") from None
        return jsonify(values)

    @control("/release_memory_occupation")
    async def release_memory_occupation() -> Response:
        req = await state.parse(MemoryOccupationRequest, optional=True)
        await steer(state.control.release_memory_occupation(list(req.tags or MEMORY_TAGS)))
        return jsonify({"success": True, "message": "Memory released."})

    @control("/resume_memory_occupation")
    async def resume_memory_occupation() -> Response:
        req = await state.parse(MemoryOccupationRequest, optional=True)
        await steer(state.control.resume_memory_occupation(list(req.tags or MEMORY_TAGS)))
        return jsonify({"success": True, "message": "Memory resumed."})

    @control("/sleep")
    async def sleep_vllm() -> Response:
        await steer(state.control.release_memory_occupation(list(MEMORY_TAGS)))
        return Response(b"", 200)

    @control("/wake_up")
    async def wake_up_vllm() -> Response:
        tags = request.args.getlist("tags") or list(MEMORY_TAGS)
        if not set(tags) <= set(MEMORY_TAGS):
            raise APIError(
                400,
                f"tags must be among {', '.join(MEMORY_TAGS)}",
                param="tags",
                code="invalid_value",
            )
        await steer(state.control.resume_memory_occupation(tags))
        return Response(b"", 200)

    @control("/is_sleeping", method="GET")
    async def is_sleeping() -> Response:
        return jsonify({"is_sleeping": state.control.is_sleeping})

    @control("/configure_logging")
    async def configure_logging() -> Response:
        req = await state.parse(ConfigureLoggingRequest, optional=True)
        changes = req.model_dump(exclude_none=True)
        if changes.get("dump_requests_folder") == "":
            changes["dump_requests_folder"] = None
        try:
            config = state.request_log.update(**changes)  # on the loop: dumps are appended here
        except (ValueError, OSError) as exc:  # e.g. a folder that cannot be made
            raise APIError(400, str(exc), code="invalid_value") from None
        return jsonify({"success": True, **dataclasses.asdict(config)})

    @control("/start_profile")
    async def start_profile() -> Response:
        req = await state.parse(StartProfileRequest)
        await steer(
            state.control.start_profile(
                req.output_dir, req.num_steps, req.activities, req.record_shapes, req.with_stack
            )
        )
        return jsonify({"success": True, "message": "Profiling started."})

    @control("/stop_profile")
    async def stop_profile() -> Response:
        await steer(state.control.stop_profile())
        return jsonify({"success": True, "message": "Profiling stopped; traces written."})

    @control("/abort_request")
    async def abort_request() -> Response:
        req = await state.parse(AbortRequest, optional=True)
        if req.abort_all:
            state.engine.abort_all()
        elif req.rid:
            state.engine.abort(req.rid)  # an unknown rid is a no-op, as in SGLang
        return Response(b"", 200)


MEMORY_TAGS: tuple[MemoryTag, ...] = get_args(MemoryTag)
UPLOAD_PATHS = frozenset({"/update_weights_from_tensor"})  # bodies streamed to a file


async def group_named_in_body() -> str:
    """The group a refused update_weights_from_distributed named, as well as it can be read."""
    try:
        body = json.loads(await request.get_data())
    except ValueError:
        body = None
    name = body.get("group_name") if isinstance(body, dict) else None
    return name if isinstance(name, str) else "weight_update_group"


def answer(success: bool, message: str) -> Response:
    """SGLang's {"success", "message"}: 200, or 400 when it failed."""
    response = jsonify({"success": success, "message": message})
    response.status_code = 200 if success else 400
    return response


def query_flag(name: str, *, default: bool) -> bool:
    value = request.args.get(name)
    if value is None:
        return default
    if value.lower() not in ("true", "false", "1", "0"):
        raise APIError(400, f"{name} must be true or false", param=name, code="invalid_value")
    return value.lower() in ("true", "1")


async def steer(call: Awaitable[None]) -> None:
    """A steering call whose ValueError (a state that forbids it) is the client's 400."""
    try:
        await call
    except ValueError as exc:
        raise APIError(400, str(exc), code="invalid_state") from None


async def flush(state: ServerState) -> None:
    try:
        await state.control.flush_cache()
    except ValueError as exc:  # requests are open
        raise APIError(400, str(exc), code="invalid_state") from None


async def pause(state: ServerState, mode: str) -> None:
    try:
        await state.control.pause(mode)
    except ValueError as exc:  # already paused
        raise APIError(400, str(exc), code="invalid_state") from None


# For /openapi.json, when the routes are on: route -> (body schema, summary); bodiless ones.
BODIES: dict[str, tuple[type[BaseModel], str]] = {
    "/pause_generation": (PauseGenerationRequest, "Pause: mode abort, wait or keep (SGLang)"),
    "/continue_generation": (ContinueGenerationRequest, "Resume after a pause (SGLang)"),
    "/abort_request": (AbortRequest, "Abort a request by rid, or all (SGLang)"),
    "/set_internal_state": (
        SetInternalStateRequest,
        "Change max_num_seqs (max_running_requests) live; answers [true] (SGLang)",
    ),
    "/start_profile": (
        StartProfileRequest,
        "Chrome traces of each actor's steps (torch.profiler in the worker) (SGLang)",
    ),
    "/configure_logging": (
        ConfigureLoggingRequest,
        "Request logging (levels 0-3) and JSONL dumps for `runtime replay` (SGLang)",
    ),
    "/get_weights_by_name": (
        GetWeightsByNameRequest,
        "The first values of a parameter, flattened, to check an update (SGLang)",
    ),
    "/release_memory_occupation": (
        MemoryOccupationRequest,
        "Free the KV cache and/or the weights; generation waits meanwhile (SGLang)",
    ),
    "/resume_memory_occupation": (MemoryOccupationRequest, "Bring them back (SGLang)"),
    "/update_weights_from_disk": (
        UpdateWeightsFromDiskRequest,
        "Serve another checkpoint's weights (SGLang); 400 with success false if it does not fit",
    ),
    "/init_weights_update_group": (
        InitWeightsUpdateGroupRequest,
        "Join the trainer's torch.distributed world; the trainer is rank 0 (SGLang)",
    ),
    "/update_weights_from_distributed": (
        UpdateWeightsFromDistributedRequest,
        "Receive one broadcast per named tensor from the trainer, then install them (SGLang)",
    ),
    "/destroy_weights_update_group": (
        DestroyWeightsUpdateGroupRequest,
        "Leave the trainer's world (SGLang)",
    ),
}
POSTS = {
    "/pause": "Pause; ?mode=abort|wait|keep (vLLM)",
    "/resume": "Resume (vLLM)",
    "/flush_cache": "Drop the prefix cache; 400 while requests are open (SGLang)",
    "/reset_prefix_cache": "Drop the prefix cache (vLLM)",
    "/sleep": "Free the KV cache and the weights (vLLM)",
    "/wake_up": "Bring them back; ?tags=weights&tags=kv_cache (vLLM)",
    "/stop_profile": "Stop profiling; answers once every trace file is written (SGLang)",
    "/update_weights_from_tensor": (
        "Install the tensors of a safetensors body (application/octet-stream), some or all of "
        "the model's; ?weight_version=&flush_cache=true|false (SGLang's route, without pickle)"
    ),
}
GETS = {
    "/is_paused": "Whether generation is paused (vLLM)",
    "/is_sleeping": "Whether memory is released (vLLM)",
}
