"""Routes that change or read the served weights: SGLang's shapes (updates from disk, from a
file, from a trainer's torch.distributed group; the weight version), behind
--enable-control-api, except reading the weight version, which is public like /model_info.
Each answers SGLang's `{"success", "message"}`: 200, or 400 when it failed.
"""

from __future__ import annotations

import json
from pathlib import Path

import trio
from pydantic import BaseModel
from quart import Response, jsonify, request
from quart_trio import QuartTrio

from api.http.errors import APIError
from api.http.state import ServerState
from api.http.uploads import body_in_file
from api.routes.control_schemas import (
    DestroyWeightsUpdateGroupRequest,
    GetWeightsByNameRequest,
    InitWeightsUpdateGroupRequest,
    TensorUploadQuery,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightVersionRequest,
)
from api.routes.guard import control_routes


def register(app: QuartTrio, state: ServerState) -> None:
    route = control_routes(app, state)
    uploading = trio.Lock()  # one weights upload at a time

    @route("/update_weights_from_disk")
    async def update_weights_from_disk() -> Response:
        req = await state.parse(UpdateWeightsFromDiskRequest)
        success, message, num_paused = await state.weights.update_weights_from_disk(
            req.model_path,
            weight_version=req.weight_version,
            flush_cache=req.flush_cache,
            abort_all_requests=req.abort_all_requests,
            keep_pause=req.keep_pause,
        )
        body = {"success": success, "message": message, "num_paused_requests": num_paused}
        response = jsonify(body)
        response.status_code = 200 if success else 400
        return response

    @route("/update_weights_from_tensor")
    async def update_weights_from_tensor() -> Response:
        if request.mimetype == "application/json":
            raise APIError(
                400,
                "the body must be a safetensors file (application/octet-stream); pickled "
                "tensors in JSON are not accepted",
                code="invalid_body",
            )
        query = state.query(TensorUploadQuery)
        try:
            async with body_in_file(".safetensors", uploading) as path:
                success, message = await state.weights.update_weights_from_tensor(
                    Path(path), weight_version=query.weight_version, flush_cache=query.flush_cache
                )
        except APIError as error:
            if error.status != 400:  # too large, too slow: errors of the request itself
                raise
            return answer(False, error.message)  # not weights: a failed update, as SGLang's
        return answer(success, message)

    @route("/init_weights_update_group")
    async def init_weights_update_group() -> Response:
        req = await state.parse(InitWeightsUpdateGroupRequest)
        success, message = await state.weights.init_weights_update_group(
            req.master_address,
            req.master_port,
            req.rank_offset,
            req.world_size,
            req.group_name,
            req.backend,
        )
        return answer(success, message)

    @route("/update_weights_from_distributed")
    async def update_weights_from_distributed() -> Response:
        try:
            req = await state.parse(UpdateWeightsFromDistributedRequest)
        except APIError as error:  # the trainer broadcasts anyway: out of step, so leave
            name = await group_named_in_body()
            await state.weights.destroy_weights_update_group(name)
            error.message += f" (the weight update group {name!r} was left: init it again)"
            raise
        success, message = await state.weights.update_weights_from_distributed(
            req.names,
            req.dtypes,
            req.shapes,
            req.group_name,
            flush_cache=req.flush_cache,
            weight_version=req.weight_version,
            abort_all_requests=req.abort_all_requests,
        )
        return answer(success, message)

    @route("/destroy_weights_update_group")
    async def destroy_weights_update_group() -> Response:
        req = await state.parse(DestroyWeightsUpdateGroupRequest, optional=True)
        return answer(*await state.weights.destroy_weights_update_group(req.group_name))

    @route("/get_weights_by_name")
    async def get_weights_by_name() -> Response:
        req = await state.parse(GetWeightsByNameRequest)
        try:
            values = await state.weights.get_weights_by_name(req.name, req.truncate_size)
        except ValueError as exc:
            raise APIError(404, str(exc), param="name", code="not_found") from None
        return jsonify(values)

    @route("/update_weight_version")
    async def update_weight_version() -> Response:
        """SGLang's and vLLM's: name the served weights (e.g. after a trainer's step)."""
        req = await state.parse(UpdateWeightVersionRequest)
        await state.weights.update_weight_version(req.new_version, req.abort_all_requests)
        version = req.new_version
        message = f"Weight version updated to {version}"
        return jsonify({"success": True, "message": message, "new_version": version})

    async def weight_version() -> Response:
        """slime's (patched SGLang) and vLLM's (`/weight_info`): readable without the control
        API, as /model_info, which says the same."""
        return jsonify({"weight_version": state.engine.model_card.weight_version})

    for rule in ("/get_weight_version", "/weight_version", "/weight_info"):
        app.add_url_rule(rule, f"weight_version{rule}", weight_version, methods=["GET"])


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


# For /openapi.json (api/routes/control.py adds them to its own).
WEIGHT_BODIES: dict[str, tuple[type[BaseModel], str]] = {
    "/get_weights_by_name": (
        GetWeightsByNameRequest,
        "The first values of a parameter, flattened, to check an update (SGLang)",
    ),
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
    "/update_weight_version": (
        UpdateWeightVersionRequest,
        "Name the served weights; aborts open requests unless told not to (SGLang, vLLM)",
    ),
}
WEIGHT_POSTS = {
    "/update_weights_from_tensor": (
        "Install the tensors of a safetensors body (application/octet-stream), some or all of "
        "the model's; ?weight_version=&flush_cache=true|false (SGLang's route, without pickle)"
    ),
}
UPLOAD_PATHS = frozenset({"/update_weights_from_tensor"})  # bodies streamed to a file
