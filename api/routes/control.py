"""Routes that steer the engine: SGLang's shapes, and vLLM's spellings of the same calls (with
their query parameters), behind --enable-control-api (api/routes/guard.py). Like every route
but the public probes, they require the API key when one is set. Weight updates are in
weights.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable
from typing import TypeVar, get_args

import trio
from pydantic import BaseModel
from quart import Response, jsonify
from quart_trio import QuartTrio

from api.http.errors import APIError
from api.http.state import ServerState
from api.routes.control_schemas import (
    AbortRequest,
    AbortRequestsRequest,
    ConfigureLoggingRequest,
    ContinueGenerationRequest,
    FlushCacheQuery,
    MemoryOccupationRequest,
    MemoryTag,
    PauseGenerationRequest,
    PauseQuery,
    ResetPrefixCacheQuery,
    SetInternalStateRequest,
    SleepQuery,
    StartProfileRequest,
    WakeUpQuery,
)
from api.routes.guard import control_routes
from api.routes.weights import WEIGHT_BODIES, WEIGHT_POSTS
from api.routes.weights import register as register_weights

BOTH = ("GET", "POST")  # SGLang serves these on either
T = TypeVar("T")


def register(app: QuartTrio, state: ServerState) -> None:
    route = control_routes(app, state)
    register_weights(app, state)

    @route("/pause_generation")
    async def pause_generation() -> Response:
        req = await state.parse(PauseGenerationRequest, optional=True)
        mode = {"in_place": "keep"}.get(req.mode, req.mode)
        paused = await steer(state.control.pause(mode))
        message = "Generation paused successfully." if paused else "Generation is already paused."
        return jsonify({"message": message, "status": "ok"})

    @route("/continue_generation")
    async def continue_generation() -> Response:
        await state.parse(ContinueGenerationRequest, optional=True)
        await steer(state.control.resume())
        return jsonify({"message": "Generation continued successfully.", "status": "ok"})

    @route("/pause")
    async def pause_vllm() -> Response:
        query = state.query(PauseQuery)
        mode = query.mode or ("wait" if query.wait_for_inflight_requests else "abort")
        await steer(state.control.pause(mode))
        if query.clear_cache and mode != "keep":  # vLLM's: nothing runs now but what waits
            await steer(state.control.flush_cache(force=True))
        return jsonify({"status": "paused"})

    @route("/resume")
    async def resume_vllm() -> Response:
        await steer(state.control.resume())
        return jsonify({"status": "resumed"})

    @route("/is_paused", methods=["GET"])
    async def is_paused() -> Response:
        return jsonify({"is_paused": state.control.is_paused})

    @route("/flush_cache", methods=BOTH)
    async def flush_cache() -> Response:
        """SGLang's: a 400 while requests are open (callers retry), unless they end within
        `?timeout=` seconds."""
        query = state.query(FlushCacheQuery)
        with trio.move_on_after(query.timeout):
            await state.engine.wait_no_requests()
        await steer(state.control.flush_cache())
        return jsonify({"success": True, "message": "Cache flushed."})

    @route("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        """vLLM's: success false while requests hold blocks, unless told to reset anyway."""
        query = state.query(ResetPrefixCacheQuery)
        try:
            await state.control.flush_cache(force=query.reset_running_requests)
        except ValueError:
            return jsonify({"success": False})
        return jsonify({"success": True})

    @route("/release_memory_occupation", methods=BOTH)
    async def release_memory_occupation() -> Response:
        req = await state.parse(MemoryOccupationRequest, optional=True)
        await steer(state.control.release_memory_occupation(memory_tags(req.tags)))
        return jsonify({"success": True, "message": "Memory released."})

    @route("/resume_memory_occupation", methods=BOTH)
    async def resume_memory_occupation() -> Response:
        req = await state.parse(MemoryOccupationRequest, optional=True)
        await steer(state.control.resume_memory_occupation(memory_tags(req.tags)))
        return jsonify({"success": True, "message": "Memory resumed."})

    @route("/sleep")
    async def sleep_vllm() -> Response:
        query = state.query(SleepQuery)
        tags = ["kv_cache"] if query.level == 1 else ["kv_cache", "weights"]
        await steer(state.control.release_memory_occupation(tags, pause_mode=query.mode))
        return jsonify({"status": "sleeping", "level": query.level})

    @route("/wake_up")
    async def wake_up_vllm() -> Response:
        query = state.query(WakeUpQuery)
        tags = [query.tags] if isinstance(query.tags, str) else query.tags
        await steer(state.control.resume_memory_occupation(memory_tags(tags)))
        status = "sleeping" if state.control.is_sleeping else "awake"
        return jsonify({"status": status, "tags": tags})

    @route("/is_sleeping", methods=["GET"])
    async def is_sleeping() -> Response:
        return jsonify({"is_sleeping": state.control.is_sleeping})

    @route("/configure_logging")
    async def configure_logging() -> Response:
        req = await state.parse(ConfigureLoggingRequest, optional=True)
        fields = ConfigureLoggingRequest.model_fields
        changes = {k: v for k, v in req.model_dump(exclude_none=True).items() if k in fields}
        folder = changes.get("dump_requests_folder")
        if folder == "":
            changes["dump_requests_folder"] = None
        elif folder is not None:
            changes["dump_requests_folder"] = state.output_folder(folder, "dumps-")
        try:
            config = state.request_log.update(**changes)  # on the loop: dumps are appended here
        except (ValueError, OSError) as exc:  # e.g. a folder that cannot be made
            raise APIError(400, str(exc), code="invalid_value") from None
        return jsonify({"success": True, **dataclasses.asdict(config)})

    @route("/start_profile", methods=BOTH)
    async def start_profile() -> Response:
        req = await state.parse(StartProfileRequest, optional=True)
        folder = state.output_folder(req.output_dir, "profile-")
        output_dir = await steer(
            state.control.start_profile(
                folder, req.num_steps, req.activities, req.record_shapes, req.with_stack
            )
        )
        return jsonify({"success": True, "message": f"Profiling into {output_dir}."})

    @route("/stop_profile", methods=BOTH)
    async def stop_profile() -> Response:
        await steer(state.control.stop_profile())
        return jsonify({"success": True, "message": "Profiling stopped; traces written."})

    @route("/abort_request")
    async def abort_request() -> Response:
        req = await state.parse(AbortRequest, optional=True)
        if req.abort_all:
            state.engine.abort_all()
        elif req.rid:
            state.engine.abort(req.rid)  # an unknown rid is a no-op, as in SGLang
        return Response(b"", 200)

    @route("/abort_requests")
    async def abort_requests() -> Response:
        """vLLM's: these requests by id, or every one if none is named."""
        req = await state.parse(AbortRequestsRequest, optional=True)
        if req.request_ids:
            aborted = sum(state.engine.abort(rid) for rid in set(req.request_ids))
        else:
            aborted = state.engine.abort_all()
        return jsonify({"status": "aborted", "aborted": aborted})


MEMORY_TAGS = ("kv_cache", "weights")  # what memory_tags(None) means: everything


def memory_tags(tags: list[MemoryTag] | None) -> list[str]:
    """The memory a release or resume names (None: all of it); "cuda_graph" needs no action of
    its own (api/routes/control_schemas.py)."""
    if tags is None:
        return list(MEMORY_TAGS)
    return [tag for tag in get_args(MemoryTag) if tag in tags and tag != "cuda_graph"]


async def steer(call: Awaitable[T]) -> T:
    """A control call whose ValueError (a state that forbids it) is the client's 400."""
    try:
        return await call
    except ValueError as exc:
        raise APIError(400, str(exc), code="invalid_state") from None


# For /openapi.json, when the routes are on: route -> (body schema, summary); bodiless ones.
BODIES: dict[str, tuple[type[BaseModel], str]] = WEIGHT_BODIES | {
    "/pause_generation": (
        PauseGenerationRequest,
        "Pause: mode abort, retract, in_place (SGLang) or wait, keep; 200 if already paused",
    ),
    "/abort_request": (AbortRequest, "Abort a request by rid, or all (SGLang)"),
    "/abort_requests": (AbortRequestsRequest, "Abort requests by id, or all (vLLM)"),
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
    "/release_memory_occupation": (
        MemoryOccupationRequest,
        "Free the KV cache and/or the weights; generation waits meanwhile (SGLang)",
    ),
    "/resume_memory_occupation": (MemoryOccupationRequest, "Bring them back (SGLang)"),
}
POSTS = WEIGHT_POSTS | {
    "/continue_generation": "Resume after a pause (SGLang)",
    "/pause": "Pause; ?mode=abort|wait|keep&clear_cache=true (vLLM)",
    "/resume": "Resume (vLLM)",
    "/flush_cache": "Drop the prefix cache; 400 while requests are open; ?timeout= (SGLang)",
    "/reset_prefix_cache": "Drop the prefix cache; ?reset_running_requests=true (vLLM)",
    "/sleep": "Free the KV cache (?level=1) or the weights too (level=2) (vLLM)",
    "/wake_up": "Bring them back; ?tags=weights&tags=kv_cache (vLLM)",
    "/stop_profile": "Stop profiling; answers once every trace file is written (SGLang)",
}
GETS = {
    "/is_paused": "Whether generation is paused (vLLM)",
    "/is_sleeping": "Whether memory is released (vLLM)",
}
