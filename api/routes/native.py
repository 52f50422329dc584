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
    json_in_pieces,
    merged,
    sse_event,
    sse_response,
)
from api.routes import logprobs_format
from api.routes.native_schemas import (
    CloseSessionRequest,
    GenerateItem,
    GenerateRequest,
    OpenSessionRequest,
)
from runtime.protocol import EngineClient


def register(app: QuartTrio, state: ServerState) -> None:
    @app.post("/generate")
    async def generate() -> Response:
        """One prompt, or a batch (a list of them): then a list of answers, in order (each
        prompt's `n` samples together), and streamed events tagged with their `index`."""
        req = await state.parse(GenerateRequest)
        items = req.items()
        n = samples_each(items)
        state.admit(len(items) * n)
        prompts = await state.encode_all([item.prompt for item in items])
        params = [req.params(item, len(p)) for item, p in zip(items, prompts, strict=True)]
        state.admit(len(items) * n)  # again: others may have come in while these tokenized
        rids = [item.rid or uuid.uuid4().hex for item in items]
        streams = await state.start(prompts, params, rids, req.session())
        shapes = [
            GenerateShape(state.engine, req, p, r) for p, r in zip(prompts, rids, strict=True)
        ]
        many = req.is_batch or n > 1
        if req.stream:
            outputs = merged(streams, state.metrics, app.nursery)
            cumulative = state.settings.cumulative_streaming_output
            return await sse_response(events(outputs, shapes, n, many, cumulative))
        results = await collect_all(streams, state.metrics, n)
        if not many:
            return jsonify(shapes[0].body(results[0], results[0]))
        bodies = (shapes[i // n].body(r, results[i - r.index]) for i, r in enumerate(results))
        return await json_in_pieces(bodies)

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


def samples_each(items: list[GenerateItem]) -> int:
    """The `n` of every prompt of a batch, which must be the same."""
    counts = {item.sampling.n for item in items}
    if len(counts) > 1:
        raise APIError(
            400,
            f"sampling_params: n must be the same for every prompt of a batch: {sorted(counts)}",
            param="sampling_params",
            code="invalid_value",
        )
    return counts.pop()


async def events(
    outputs: Merged, shapes: list[GenerateShape], n: int, many: bool, cumulative: bool
) -> AsyncIterator[bytes]:
    """Each event carries what is new in one answer (its text, ids and log-probabilities
    since the last event; the input's log-probabilities in sample 0's first), tagged with its
    `index` (prompt * n + sample) when there are several. `cumulative`: the whole answer so
    far instead, as SGLang's events by default (slime's streaming rollout reads them so)."""
    results = [Collected(index=i % n) for i in range(len(shapes) * n)]
    try:
        async with aclosing(outputs):
            async for prompt, out in outputs:
                index = prompt * n + out.index
                result, first = results[index], results[prompt * n]
                opening = not result.token_ids and result.finish_reason is None
                result.add(out)
                if cumulative:
                    body = shapes[prompt].body(result, first)
                else:
                    piece = Collected(index=out.index)
                    piece.add(out)
                    with_input = opening and out.index == 0  # sample 0 carries the input's
                    body = shapes[prompt].body(result, piece if with_input else None, piece)
                yield sse_event(body | {"index": index} if many else body)
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

    def body(
        self, result: Collected, first: Collected | None, shown: Collected | None = None
    ) -> dict[str, Any]:
        """The answer so far, `result`; with its text, ids and output log-probabilities
        those of `shown` (a streamed event's new piece) if given. `first`: the request's
        first sample, which has the prompt's log-probabilities (None: none shown)."""
        shown = shown or result
        meta = {
            "id": self.rid,
            "finish_reason": finish_reason(result),
            "prompt_tokens": result.num_prompt_tokens,
            "completion_tokens": len(result.token_ids),
            "cached_tokens": result.num_cached_tokens,
            "weight_version": self.weight_version,
        }
        if self.req.return_logprob:
            meta |= self._logprobs(shown, first)
        return {"text": shown.text, "output_ids": shown.token_ids, "meta_info": meta}

    def _logprobs(self, shown: Collected, first: Collected | None) -> dict[str, Any]:
        """SGLang's: the input's from `logprob_start_len` on, its first entry always null."""
        req, with_text = self.req, self.req.return_text_in_logprobs
        inputs: list[list[Any]] = []
        input_tops: list[list[list[Any]] | None] = []
        if first is not None:
            start = req.logprob_start(len(self.prompt))
            scored = [logprobs_format.Scored(self.prompt[start], None, None)]
            scored += logprobs_format.prompt(first.prompt_logprobs or [])
            inputs, input_tops = logprobs_format.sglang(self.engine, scored, with_text)
        generated = logprobs_format.generated(shown.token_ids, shown.logprobs, shown.top_logprobs)
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
        case "abort":  # SGLang's words: AReaL reads "before prefill" as "no tokens came"
            started = "Abort during generation" if result.token_ids else "Abort before prefill"
            return {"type": "abort", "message": started}
        case other:
            return {"type": other}
