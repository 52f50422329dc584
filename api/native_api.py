"""SGLang's native `POST /generate`: text or token ids in, text, ids and meta_info out."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from quart import Response, jsonify
from quart_trio import QuartTrio

from api.errors import APIError
from api.schemas import CloseSessionRequest, GenerateRequest, OpenSessionRequest
from api.state import ServerState
from api.streaming import (
    SSE_DONE,
    Collected,
    Merged,
    collect_all,
    error_event,
    merged,
    sse_event,
    sse_response,
)


def register(app: QuartTrio, state: ServerState) -> None:
    @app.post("/generate")
    async def generate() -> Response:
        req = await state.parse(GenerateRequest)
        state.admit()
        rid = req.rid or uuid.uuid4().hex
        (prompt,) = await state.encode_all([req.prompt()])
        state.admit()  # again: others may have come in while this one tokenized
        streams = state.start([prompt], req.params(), [rid], req.session())
        version = state.engine.model_card.weight_version
        if req.stream:
            outputs = merged(streams, state.metrics, app.nursery)
            return await sse_response(events(outputs, rid, version))
        (result,) = await collect_all(streams, state.metrics)
        return jsonify(body(rid, result, version))

    @app.post("/open_session")
    async def open_session() -> Response:
        """A session for multi-turn requests whose history's KV the engine keeps."""
        req = await state.parse(OpenSessionRequest)
        try:
            session_id = state.engine.open_session(
                req.capacity_of_str_len, req.session_id, req.timeout
            )
        except ValueError as exc:
            raise APIError(400, str(exc), param="session_id", code="invalid_value") from None
        return jsonify(session_id)

    @app.post("/close_session")
    async def close_session() -> Response:
        req = await state.parse(CloseSessionRequest)
        try:
            state.engine.close_session(req.session_id)
        except ValueError as exc:
            raise APIError(400, str(exc), param="session_id", code="invalid_value") from None
        return Response(b"", 200)


async def events(outputs: Merged, rid: str, weight_version: str) -> AsyncIterator[bytes]:
    """Like SGLang: each event carries the whole text and ids so far."""
    result = Collected()
    try:
        async with aclosing(outputs):
            async for _, out in outputs:
                result.add(out)
                yield sse_event(body(rid, result, weight_version))
    except Exception as exc:
        yield error_event(exc)
    yield SSE_DONE


def body(rid: str, result: Collected, weight_version: str) -> dict[str, Any]:
    return {
        "text": result.text,
        "output_ids": result.token_ids,
        "meta_info": {
            "id": rid,
            "finish_reason": finish_reason(result),
            "prompt_tokens": result.num_prompt_tokens,
            "completion_tokens": len(result.token_ids),
            "cached_tokens": result.num_cached_tokens,
            "weight_version": weight_version,
        },
    }


def finish_reason(result: Collected) -> dict[str, Any] | None:
    match result.finish_reason:
        case None:
            return None
        case "stop":
            return {"type": "stop", "matched": result.matched_stop}
        case "length":
            return {"type": "length", "length": len(result.token_ids)}
        case other:
            return {"type": other}
