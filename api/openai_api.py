"""OpenAI-compatible `POST /v1/completions` and `POST /v1/chat/completions`."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, Literal

from quart import Response, jsonify
from quart_trio import QuartTrio

from api.schemas import ChatCompletionRequest, CompletionRequest
from api.state import ServerState
from api.streaming import (
    SSE_DONE,
    Collected,
    Merged,
    TextChunks,
    collect_all,
    error_event,
    merged,
    sse_event,
    sse_response,
)
from runtime.engine_client import RequestOutput


def register(app: QuartTrio, state: ServerState) -> None:
    @app.post("/v1/completions")
    async def completions() -> Response:
        req = await state.parse(CompletionRequest)
        state.check_model(req.model)
        prompts = req.prompts()
        state.admit(len(prompts))
        token_ids = await state.encode_all(prompts)
        state.admit(len(prompts))  # again: others may have come in while this one tokenized
        head = response_head(state, f"cmpl-{uuid.uuid4().hex}", "text_completion")
        rids = [f"{head['id']}-{i}" for i in range(len(prompts))]
        streams = state.start(token_ids, req.sampling_params(req.max_tokens), rids)
        if req.stream:
            outputs = merged(streams, state.metrics, app.nursery)
            return await sse_response(completion_events(outputs, head, req.include_usage))
        results = await collect_all(streams, state.metrics)
        choices = [completion_choice(i, r) for i, r in enumerate(results)]
        return jsonify(head | {"choices": choices, "usage": usage(results)})

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        req = await state.parse(ChatCompletionRequest)
        state.check_model(req.model)
        state.admit()
        params = req.sampling_params(req.max_output_tokens)
        prompt = await state.chat_prompt(req.conversation())
        state.admit()  # again: others may have come in while this one was rendered
        head = response_head(state, f"chatcmpl-{uuid.uuid4().hex}", "chat.completion")
        streams = state.start([prompt], params, [head["id"]])
        if req.stream:
            head["object"] = "chat.completion.chunk"
            outputs = merged(streams, state.metrics, app.nursery)
            return await sse_response(chat_events(outputs, head, req.include_usage))
        (result,) = await collect_all(streams, state.metrics)
        message = {"role": "assistant", "content": result.text}
        choice = chat_choice("message", message, result)
        return jsonify(head | {"choices": [choice], "usage": usage([result])})


def response_head(state: ServerState, request_id: str, kind: str) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": kind,
        "created": int(time.time()),
        "model": state.settings.served_model_name,
    }


def completion_choice(index: int, end: Collected | RequestOutput) -> dict[str, Any]:
    """A choice's last (or only) piece: its text, and why it ended."""
    return {
        "index": index,
        "text": end.text,
        "logprobs": None,
        "finish_reason": end.finish_reason,
        "stop_reason": end.matched_stop,
    }


def chat_choice(
    key: Literal["message", "delta"],
    content: dict[str, Any],
    end: Collected | RequestOutput | None = None,
) -> dict[str, Any]:
    """A chat choice: `key` is "message" (whole) or "delta" (a streamed chunk)."""
    return {
        "index": 0,
        key: content,
        "logprobs": None,
        "finish_reason": end.finish_reason if end is not None else None,
        "stop_reason": end.matched_stop if end is not None else None,
    }


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
    outputs: Merged, head: dict[str, Any], include_usage: bool
) -> AsyncIterator[bytes]:
    results: dict[int, Collected] = {}
    chunks = TextChunks(
        head, ',"text":', ',"logprobs":null,"finish_reason":null,"stop_reason":null'
    )
    try:
        async with aclosing(outputs):
            async for i, out in outputs:
                results.setdefault(i, Collected()).add(out)
                if out.finished:
                    yield sse_event(head | {"choices": [completion_choice(i, out)]})
                elif out.text:
                    yield chunks.event(i, out.text)
    except Exception as exc:  # the status line is gone: report in-band, then end the stream
        yield error_event(exc)
    if include_usage:
        yield sse_event(head | {"choices": [], "usage": usage(list(results.values()))})
    yield SSE_DONE


async def chat_events(
    outputs: Merged, head: dict[str, Any], include_usage: bool
) -> AsyncIterator[bytes]:
    result = Collected()
    role = {"role": "assistant", "content": ""}  # OpenAI sends the role first, on its own
    yield sse_event(head | {"choices": [chat_choice("delta", role)]})
    chunks = TextChunks(
        head, ',"delta":{"content":', '},"logprobs":null,"finish_reason":null,"stop_reason":null'
    )
    try:
        async with aclosing(outputs):
            async for _, out in outputs:
                result.add(out)
                if out.text:
                    yield chunks.event(0, out.text)
                if out.finished:
                    yield sse_event(head | {"choices": [chat_choice("delta", {}, out)]})
    except Exception as exc:
        yield error_event(exc)
    if include_usage:
        yield sse_event(head | {"choices": [], "usage": usage([result])})
    yield SSE_DONE
