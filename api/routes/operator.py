"""What routers and operators poll: SGLang's load report and server info, the one setting that
may change live, and a health check that really generates.

`smg` (the SGLang gateway) reads `/v1/loads` for its load-aware policies, and `/server_info`
and `/model_info` when a worker registers.
"""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime
from importlib.metadata import version
from typing import Any

import trio
from quart import Response, jsonify, request
from quart_trio import QuartTrio

from api.http.errors import APIError
from api.http.state import ServerState
from api.routes.control_schemas import SetInternalStateRequest
from runtime.protocol import EngineDeadError, SamplingParams

LOAD_SECTIONS = ("core", "memory", "spec", "lora", "disagg", "queues", "all")  # SGLang's


def register(app: QuartTrio, state: ServerState) -> None:
    server_version = version("trio-llm-runtime")

    @app.get("/v1/loads")
    async def loads() -> Response:
        unknown = set(request.args.get("include", "all").split(",")) - set(LOAD_SECTIONS)
        if unknown:
            raise APIError(
                400,
                f"unknown include sections {sorted(unknown)}; known: {', '.join(LOAD_SECTIONS)}",
                param="include",
                code="invalid_value",
            )
        ranks = state.engine.get_loads()
        count = len(ranks)
        wanted = request.args.get("dp_rank")
        if wanted is not None:
            ranks = [load for load in ranks if str(load["dp_rank"]) == wanted]
        body = {
            "timestamp": datetime.now(UTC).isoformat(),
            "version": server_version,
            "dp_rank_count": count,
            "loads": ranks,
        }
        return jsonify(body)

    @app.get("/get_load")
    async def get_load() -> Response:
        return jsonify([legacy_load(load) for load in state.engine.get_loads()])

    async def server_info() -> Response:
        internal = state.engine.get_internal_state()
        settings = state.settings
        info = state.engine.server_info() | {
            "served_model_name": settings.served_model_name,
            "max_open_requests": settings.max_open_requests,
            "request_timeout": settings.request_timeout,
            "enable_control_api": settings.enable_control_api,
            "api_key_required": settings.api_key is not None,  # never the key itself
            "status": "ready",
            "max_total_num_tokens": sum(i["memory_usage"]["token_capacity"] for i in internal),
            "internal_states": internal,
            "version": server_version,
        }
        return jsonify(info)

    app.add_url_rule("/get_server_info", view_func=server_info, methods=["GET"])
    app.add_url_rule("/server_info", "server_info_alias", server_info, methods=["GET"])

    @app.route("/set_internal_state", methods=["POST", "PUT"])
    async def set_internal_state() -> Response:
        if not state.settings.enable_control_api:  # it changes how the engine serves
            raise APIError(
                404,
                "/set_internal_state is off: start the server with --enable-control-api",
                code="control_api_disabled",
            )
        req = await state.parse(SetInternalStateRequest)
        try:
            await state.control.set_internal_state(req.server_args)
        except ValueError as exc:
            raise APIError(400, str(exc), param="server_args", code="invalid_value") from None
        return jsonify([True] * len(state.engine.get_loads()))  # one per dp rank, as SGLang

    @app.get("/health_generate")
    async def health_generate() -> Response:
        """One greedy token through every actor, outside the request metrics."""
        if state.draining or state.control.is_paused:
            why = "draining" if state.draining else "paused"
            raise APIError(503, f"the server is {why}: it generates nothing", code="unhealthy")
        state.admit()  # a probe, but not a way past --max-open-requests
        params = SamplingParams(max_tokens=1, temperature=0.0)
        rid = f"HEALTH_CHECK_{uuid.uuid4().hex}"
        with trio.move_on_after(state.settings.health_generate_timeout):
            try:
                async for _ in state.engine.generate([0], params, rid=rid):
                    pass
            except EngineDeadError as exc:
                raise APIError(503, f"the engine is dead: {exc}", code="unhealthy") from None
            return Response(b"", 200)
        raise APIError(503, "the engine generated nothing in time", code="unhealthy")


def legacy_load(entry: dict[str, Any]) -> dict[str, Any]:
    """SGLang's older `/get_load` entry (0.5.10's keys)."""
    return {
        "dp_rank": entry["dp_rank"],
        "num_reqs": entry["num_total_reqs"],
        "num_waiting_reqs": entry["num_waiting_reqs"],
        "num_tokens": entry["num_used_tokens"] + entry["num_waiting_uncached_tokens"],
        "ts_tic": time.perf_counter(),
    }
