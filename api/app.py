"""The quart-trio application: routes, authentication, and errors as OpenAI error objects.

`create_app` takes any `EngineClient`; this package never imports the concrete engine.
"""

from __future__ import annotations

import time
from importlib.metadata import version

import trio
from quart import Response, g, jsonify, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from api.http.budget import BodyBudget, bearer_is
from api.http.errors import APIError, engine_stopped, timed_out
from api.http.fields import header_value
from api.http.state import RETRY, ServerSettings, ServerState
from api.routes import control, embeddings, native, openai, operator, playground, trl, weights
from api.routes.openai_schemas import DetokenizeRequest, TokenizeRequest
from api.routes.openapi import openapi
from runtime.protocol import (
    EngineClient,
    EngineDeadError,
    RequestAbortedError,
    RequestTimeoutError,
)

# Paths anyone may read without the API key: probes and scrapers rarely carry one; the
# playground page holds no data (its API calls send the key the user types).
_PUBLIC = frozenset({"/health", "/metrics", "/openapi.json"}) | playground.public_paths()
DUMP_DRAIN_TIMEOUT = 10.0  # seconds the last dumped requests get to be written at shutdown


def create_app(engine: EngineClient, settings: ServerSettings) -> QuartTrio:
    app = QuartTrio(__name__)
    uploading = weights.UPLOAD_PATHS if settings.enable_control_api else frozenset[str]()
    budget = BodyBudget(
        lambda: engine.model_card.max_model_len, settings.max_body_bytes, uploading,
        settings.api_key,
    )  # fmt: skip
    app.request_class = budget.request_class()  # each route's byte limit (api/http/budget.py)
    app.config.update(
        RESPONSE_TIMEOUT=None,  # never cut a long stream (Quart's default is 60 s)
        BODY_TIMEOUT=60,
    )
    # keys in the order the handlers build them: a completion's top_logprobs lists the
    # sampled token first, as vLLM's do (Quart sorts them by default)
    app.json.sort_keys = False  # type: ignore[attr-defined]
    state = ServerState(engine, settings, budget)
    app.extensions["runtime"] = state
    _register_basics(app, state)
    openai.register(app, state)
    embeddings.register(app, state)
    native.register(app, state)
    control.register(app, state)
    operator.register(app, state)
    trl.register(app, state)
    playground.register(app, state)
    _register_errors(app)

    @app.before_serving
    async def start_dump_writer() -> None:
        app.nursery.start_soon(state.request_log.write_dumps)

    @app.after_serving
    async def write_last_dumps() -> None:
        state.request_log.close()
        with trio.move_on_after(DUMP_DRAIN_TIMEOUT):
            await state.request_log.written.wait()

    return app


def server_state(app: QuartTrio) -> ServerState:
    state: ServerState = app.extensions["runtime"]
    return state


def _register_basics(app: QuartTrio, state: ServerState) -> None:
    created = int(time.time())
    document = openapi(version("trio-llm-runtime"), control=state.settings.enable_control_api)

    @app.before_request
    async def authenticate() -> None:
        key = state.settings.api_key
        if key is None or request.path in _PUBLIC:
            return
        if not bearer_is(request.headers, key):
            state.refusals.note(f"refused a request to {request.path} without the API key",
                                request.remote_addr or "?")  # fmt: skip
            raise APIError(
                401,
                "missing or wrong API key",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    @app.after_request
    async def name_ignored_fields(response: Response) -> Response:
        ignored = g.get("ignored_fields")
        if ignored:
            response.headers["X-Ignored-Fields"] = header_value(ignored)
        return response

    @app.get("/health")
    async def health() -> Response:
        with trio.move_on_after(state.settings.health_timeout):
            busy = await state.engine.check_health()
            return jsonify({"status": "ok"} | ({"busy": busy} if busy else {}))
        culprit = await state.engine.diagnose()
        app.logger.warning("health check: %s", culprit)
        raise APIError(503, f"the engine did not answer in time: {culprit}", code="unhealthy")

    @app.get("/openapi.json")
    async def openapi_json() -> Response:
        return jsonify(document)

    @app.get("/v1/models")
    async def models() -> Response:
        card = state.engine.model_card
        model = {
            "id": state.settings.served_model_name,
            "object": "model",
            "created": created,
            "owned_by": "runtime",
            "root": card.path,
            "max_model_len": card.max_model_len,
        }
        return jsonify({"object": "list", "data": [model]})

    @app.get("/get_model_info")
    @app.get("/model_info")  # what smg asks a worker it registers
    async def get_model_info() -> Response:
        """SGLang's; read-only, so served without --enable-control-api."""
        card = state.engine.model_card
        return jsonify(
            {
                "model_path": card.path,
                "tokenizer_path": card.path,
                "is_generation": True,
                "weight_version": card.weight_version,
                "served_model_name": state.settings.served_model_name,
                "max_model_len": card.max_model_len,
            }
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(
            state.metrics.render(),
            200,
            {"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )

    @app.post("/tokenize")
    async def tokenize() -> Response:
        req = await state.parse(TokenizeRequest)
        state.check_model(req.model)
        param, text, special = "prompt", req.prompt or "", req.add_special_tokens
        if req.messages is not None:
            param, special = "messages", False
            tools = [tool.as_dict() for tool in req.tools or []] or None
            text = await state.chat_text([m.as_dict() for m in req.messages], None, tools)
        tokens = await state.encode(text, param=param, add_special_tokens=special)
        card = state.engine.model_card
        return jsonify(
            {"count": len(tokens), "max_model_len": card.max_model_len, "tokens": tokens}
        )

    @app.post("/detokenize")
    async def detokenize() -> Response:
        req = await state.parse(DetokenizeRequest)
        state.check_model(req.model)
        try:
            text = await state.engine.detokenize(req.tokens)
        except ValueError as exc:
            raise APIError(400, str(exc), param="tokens") from None
        return jsonify({"prompt": text})


def _register_errors(app: QuartTrio) -> None:
    @app.errorhandler(APIError)
    async def api_error(error: APIError) -> Response:
        return _error_response(error)

    @app.errorhandler(RequestEntityTooLarge)
    async def too_large(error: RequestEntityTooLarge) -> Response:
        return _error_response(server_state(app).budget.too_large(request.path))

    @app.errorhandler(HTTPException)
    async def http_error(error: HTTPException) -> Response:  # 404 route, 405 ...
        status = error.code or 500
        return _error_response(APIError(status, error.description or error.name))

    @app.errorhandler(EngineDeadError)
    async def engine_dead(error: EngineDeadError) -> Response:
        return _error_response(engine_stopped(error))

    @app.errorhandler(RequestTimeoutError)
    async def request_timeout(error: RequestTimeoutError) -> Response:
        return _error_response(timed_out(error))

    @app.errorhandler(RequestAbortedError)
    async def request_aborted(error: RequestAbortedError) -> Response:  # e.g. a pause, a drain
        return _error_response(APIError(503, str(error), code="aborted", headers=RETRY))

    @app.errorhandler(Exception)
    async def internal_error(error: Exception) -> Response:
        app.logger.exception("request failed", exc_info=error)
        return _error_response(APIError(500, f"internal error: {type(error).__name__}"))


def _error_response(error: APIError) -> Response:
    response = jsonify(error.body())
    response.status_code = error.status
    response.headers.update(error.headers)
    return response
