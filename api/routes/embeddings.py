"""Embeddings: OpenAI's `POST /v1/embeddings` and SGLang's native `POST /encode`, served by the
same engine that generates (each input a prefill-only request in the shared batch)."""

from __future__ import annotations

import base64
import math
import uuid
from typing import Any

import trio
from quart import Response, g, jsonify, request
from quart_trio import QuartTrio

from api.http.errors import APIError
from api.http.state import ServerState
from api.http.streaming import json_in_pieces
from api.routes.embedding_schemas import EmbeddingRequest, EncodeRequest
from runtime.protocol import Embedding, FieldError, PoolingParams, RequestTimeoutError


def register(app: QuartTrio, state: ServerState) -> None:
    @app.post("/v1/embeddings")
    async def embeddings() -> Response:
        req = await state.parse(EmbeddingRequest)
        state.check_model(req.model)
        params = req.pooling_params()
        inputs = req.inputs()
        rids = [f"embd-{uuid.uuid4().hex}-{i}" for i in range(len(inputs))]
        results = await embed(state, inputs, params, "input", rids, req.add_special_tokens)
        data = (embedding_item(r, req.encoding_format) for r in results)
        prompt_tokens = sum(r.num_prompt_tokens for r in results)
        tail = {
            "model": state.settings.served_model_name,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        }
        return await json_in_pieces(data, {"object": "list"}, "data", tail)

    @app.post("/encode")
    async def encode() -> Response:
        """SGLang's: one answer per input, `{"embedding", "meta_info"}`; a list for a batch."""
        req = await state.parse(EncodeRequest)
        inputs = req.inputs()
        rids = req.rids(len(inputs))
        results = await embed(state, inputs, req.pooling_params(), req.field, rids)
        answers = [encode_answer(r, rid) for r, rid in zip(results, rids, strict=True)]
        if not req.is_batch:
            return jsonify(answers[0])
        return await json_in_pieces(answers)


async def embed(
    state: ServerState,
    inputs: list[str | list[int]],
    params: PoolingParams,
    field: str,
    rids: list[str],
    add_special_tokens: bool = True,
) -> list[Embedding]:
    """The inputs' vectors; a 400 naming the field (`field`: the route's name for the
    inputs) for bad input, as many inputs as --max-embedding-inputs at most. `rids` name the
    inputs in the request log."""
    limit = state.settings.max_embedding_inputs
    if len(inputs) > limit:
        raise APIError(
            400,
            f"{field}: {len(inputs)} inputs in one request, at most {limit} "
            "(--max-embedding-inputs)",
            param=field,
            code="too_many_inputs",
        )
    state.admit(len(inputs))  # each input is a sequence, as a prompt of a completion is
    log = state.request_log
    entry = log.begin(request.path, g.get("body", {}), rids) if log.active else None
    limit_s = state.settings.request_timeout
    try:
        with trio.move_on_after(limit_s or math.inf) as deadline:  # cancelled: all aborted
            results = await state.engine.embed(
                inputs, params, add_special_tokens=add_special_tokens
            )
            if entry is not None:
                log.embedded(entry, results)
            return results
    except FieldError as exc:
        named = exc.field.startswith("inputs")  # the engine's name for the inputs
        param = field + exc.field.removeprefix("inputs") if named else exc.field
        code = "context_length_exceeded" if "context length" in exc.reason else "invalid_value"
        raise APIError(400, f"{param}: {exc.reason}", param=param, code=code) from None
    except ValueError as exc:  # the scheduler refused an input (the engine checked them all)
        raise APIError(400, str(exc), param=field, code="invalid_value") from None
    assert deadline.cancelled_caught
    raise RequestTimeoutError(f"the request ran past its {limit_s:g} s timeout")


def embedding_item(result: Embedding, encoding_format: str) -> dict[str, Any]:
    """One entry of OpenAI's `data`: the values, or their little-endian float32 bytes in
    base64 (what the official client asks for unless told otherwise)."""
    if encoding_format == "base64":
        vector: list[float] | str = base64.b64encode(result.data).decode()
    else:
        vector = result.embedding
    return {"object": "embedding", "index": result.index, "embedding": vector}


def encode_answer(result: Embedding, rid: str) -> dict[str, Any]:
    """SGLang's answer: its embeddings end as a request of max_new_tokens 0 does."""
    meta = {
        "id": rid,
        "finish_reason": {"type": "length", "length": 0},
        "prompt_tokens": result.num_prompt_tokens,
        "cached_tokens": result.num_cached_tokens,
    }
    return {"embedding": result.embedding, "meta_info": meta}
