"""SGLang's native `POST /generate`: text or token ids in, text, ids and meta_info out."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from quart import Response, jsonify
from quart_trio import QuartTrio

from api.http.errors import APIError
from api.http.state import ServerState
from api.http.streaming import (
    SSE_DONE,
    Collected,
    Merged,
    collect_all,
    error_event,
    merged,
    sse_event,
    sse_response,
)
from api.routes import logprobs_format
from api.routes.schemas import CloseSessionRequest, GenerateRequest, OpenSessionRequest
from runtime.protocol import EngineClient


def register(app: QuartTrio, state: ServerState) -> None:
    @app.post("/generate")
    async def generate() -> Response:
        req = await state.parse(GenerateRequest)
        n = req.sampling_params.n
        state.admit(n)
        rid = req.rid or uuid.uuid4().hex
        (prompt,) = await state.encode_all([req.prompt()])
        params = req.params(len(prompt))
        state.admit(n)  # again: others may have come in while this one tokenized
        streams = state.start([prompt], params, [rid], req.session())
        shape = GenerateShape(state.engine, req, prompt, rid)
        if req.stream:
            outputs = merged(streams, state.metrics, app.nursery)
            return await sse_response(events(outputs, shape, n))
        results = await collect_all(streams, state.metrics, n)
        bodies = [shape.body(r, results[0]) for r in results]
        return jsonify(bodies if n > 1 else bodies[0])

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


async def events(outputs: Merged, shape: GenerateShape, n: int) -> AsyncIterator[bytes]:
    """Like SGLang: each event carries the whole text and ids so far (and, with n > 1, the
    sample's `index`)."""
    results = [Collected(index=i) for i in range(n)]
    try:
        async with aclosing(outputs):
            async for _, out in outputs:
                result = results[out.index]
                result.add(out)
                body = shape.body(result, results[0])
                yield sse_event(body | {"index": out.index} if n > 1 else body)
    except Exception as exc:
        yield error_event(exc)
    yield SSE_DONE


class GenerateShape:
    """`/generate` answers: text, ids, meta_info (with log-probabilities if asked)."""

    def __init__(
        self, engine: EngineClient, req: GenerateRequest, prompt: list[int], rid: str
    ) -> None:
        self.engine = engine
        self.req = req
        self.prompt = prompt
        self.rid = rid
        self.weight_version = engine.model_card.weight_version

    def body(self, result: Collected, first: Collected) -> dict[str, Any]:
        """`first`: the request's first sample, which has the prompt's log-probabilities."""
        meta = {
            "id": self.rid,
            "finish_reason": finish_reason(result),
            "prompt_tokens": result.num_prompt_tokens,
            "completion_tokens": len(result.token_ids),
            "cached_tokens": result.num_cached_tokens,
            "weight_version": self.weight_version,
        }
        if self.req.return_logprob:
            meta |= self._logprobs(result, first)
        return {"text": result.text, "output_ids": result.token_ids, "meta_info": meta}

    def _logprobs(self, result: Collected, first: Collected) -> dict[str, Any]:
        """SGLang's: the input's from `logprob_start_len` on, its first entry always null."""
        req, with_text = self.req, self.req.return_text_in_logprobs
        start = req.logprob_start(len(self.prompt))
        scored = [logprobs_format.Scored(self.prompt[start], None, None)]
        scored += logprobs_format.prompt(first.prompt_logprobs or [])
        inputs, input_tops = logprobs_format.sglang(self.engine, scored, with_text)
        generated = logprobs_format.generated(
            result.token_ids, result.logprobs, result.top_logprobs
        )
        outputs, output_tops = logprobs_format.sglang(self.engine, generated, with_text)
        meta: dict[str, Any] = {"input_token_logprobs": inputs, "output_token_logprobs": outputs}
        if req.top_logprobs_num > 0:
            meta |= {"input_top_logprobs": input_tops, "output_top_logprobs": output_tops}
        return meta


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
