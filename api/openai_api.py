"""OpenAI-compatible `POST /v1/completions` and `POST /v1/chat/completions`."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

from quart import Quart, Response, jsonify

from api.errors import APIError
from api.schemas import ChatCompletionRequest, CompletionRequest
from api.state import ServerState
from api.streaming import (
    SSE_DONE,
    Collected,
    TextChunks,
    collect_all,
    error_event,
    merged,
    sse_event,
    sse_response,
)
from runtime.request_stream import RequestOutput
from runtime.sampling_params import SamplingParams


def register(app: Quart, state: ServerState) -> None:
    @app.post("/v1/completions")
    async def completions() -> Response:
        req = await state.parse(CompletionRequest)
        state.check_model(req.model)
        state.admit()
        params = req.sampling_params(req.max_tokens)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        prompts = req.prompts()
        streams = start(state, prompts, params, [f"{request_id}-{i}" for i in range(len(prompts))])
        head = {
            "id": request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": state.settings.served_model_name,
        }
        if req.stream:
            return await sse_response(
                completion_events(state, app, streams, head, req.include_usage)
            )
        results = await collect_all(streams, state.metrics)
        choices = [
            {
                "index": i,
                "text": r.text,
                "logprobs": None,
                "finish_reason": r.finish_reason,
                "stop_reason": r.matched_stop,
            }
            for i, r in enumerate(results)
        ]
        return jsonify(head | {"choices": choices, "usage": usage(results)})

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        req = await state.parse(ChatCompletionRequest)
        state.check_model(req.model)
        state.admit()
        params = req.sampling_params(req.max_output_tokens)
        prompt = render_chat(state, req.conversation())
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = start(state, [prompt], params, [request_id])
        head = {
            "id": request_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": state.settings.served_model_name,
        }
        if req.stream:
            head["object"] = "chat.completion.chunk"
            return await sse_response(chat_events(state, app, streams, head, req.include_usage))
        (result,) = await collect_all(streams, state.metrics)
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": result.text},
            "logprobs": None,
            "finish_reason": result.finish_reason,
            "stop_reason": result.matched_stop,
        }
        return jsonify(head | {"choices": [choice], "usage": usage([result])})


def start(
    state: ServerState, prompts: list[Any], params: SamplingParams, rids: list[str]
) -> list[AsyncGenerator[RequestOutput, None]]:
    """Validate every prompt before any is queued; a bad one is a 400 for the whole request."""
    try:
        return [
            state.engine.generate(prompt, params, rid=rid)
            for prompt, rid in zip(prompts, rids, strict=True)
        ]
    except ValueError as exc:
        code = "context_length_exceeded" if "context" in str(exc) else "invalid_value"
        raise APIError(400, str(exc), code=code) from None


def render_chat_text(state: ServerState, conversation: list[dict[str, str]]) -> str:
    try:
        return state.engine.apply_chat_template(conversation)
    except ValueError as exc:
        raise APIError(400, str(exc), param="messages") from None


def render_chat(state: ServerState, conversation: list[dict[str, str]]) -> list[int]:
    # the template already holds whatever special tokens (BOS...) the model wants
    text = render_chat_text(state, conversation)
    try:
        return state.engine.tokenize(text, add_special_tokens=False)
    except ValueError as exc:  # e.g. a lone surrogate, which JSON can carry
        raise APIError(400, str(exc), param="messages") from None


def usage(results: list[Collected]) -> dict[str, Any]:
    prompt = sum(r.num_prompt_tokens for r in results)
    completion = sum(len(r.token_ids) for r in results)
    cached = sum(r.num_cached_tokens for r in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


async def completion_events(
    state: ServerState,
    app: Any,
    streams: list[AsyncGenerator[RequestOutput, None]],
    head: dict[str, Any],
    include_usage: bool,
) -> AsyncIterator[bytes]:
    results = [Collected() for _ in streams]
    chunks = TextChunks(
        head, ',"text":', ',"logprobs":null,"finish_reason":null,"stop_reason":null'
    )
    try:
        async with aclosing(merged(streams, state.metrics, app.nursery)) as outputs:
            async for i, out in outputs:
                results[i].add(out)
                if out.text and not out.finished:
                    yield chunks.event(i, out.text)
                elif out.finished:
                    choice = {
                        "index": i,
                        "text": out.text,
                        "logprobs": None,
                        "finish_reason": out.finish_reason,
                        "stop_reason": out.matched_stop,
                    }
                    yield sse_event(head | {"choices": [choice]})
    except Exception as exc:  # the status line is gone: report in-band, then end the stream
        yield error_event(exc)
    if include_usage:
        yield sse_event(head | {"choices": [], "usage": usage(results)})
    yield SSE_DONE


async def chat_events(
    state: ServerState,
    app: Any,
    streams: list[AsyncGenerator[RequestOutput, None]],
    head: dict[str, Any],
    include_usage: bool,
) -> AsyncIterator[bytes]:
    result = Collected()
    delta = {"role": "assistant", "content": ""}  # OpenAI sends the role first, on its own
    yield sse_event(head | {"choices": [chat_choice(delta, None)]})
    chunks = TextChunks(
        head, ',"delta":{"content":', '},"logprobs":null,"finish_reason":null,"stop_reason":null'
    )
    try:
        async with aclosing(merged(streams, state.metrics, app.nursery)) as outputs:
            async for _, out in outputs:
                result.add(out)
                if out.text:
                    yield chunks.event(0, out.text)
                if out.finished:
                    choice = chat_choice({}, out.finish_reason, out.matched_stop)
                    yield sse_event(head | {"choices": [choice]})
    except Exception as exc:
        yield error_event(exc)
    if include_usage:
        yield sse_event(head | {"choices": [], "usage": usage([result])})
    yield SSE_DONE


def chat_choice(
    delta: dict[str, Any], finish_reason: str | None = None, stop_reason: Any = None
) -> dict[str, Any]:
    return {
        "index": 0,
        "delta": delta,
        "logprobs": None,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }
