"""OpenAI-compatible `POST /v1/completions` and `POST /v1/chat/completions`."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, Literal

from quart import Response
from quart_trio import QuartTrio

from api.http.state import ServerState
from api.http.streaming import (
    SSE_DONE,
    Collected,
    Merged,
    TextChunks,
    collect_all,
    error_event,
    json_in_pieces,
    merged,
    sse_event,
    sse_response,
)
from api.routes import logprobs_format
from api.routes.openai_schemas import ChatCompletionRequest, CompletionRequest
from api.tools.choice import tool_choice
from api.tools.stream import ToolCallReader, ToolCallStream, read_calls
from runtime.protocol import EngineClient, RequestOutput


def register(app: QuartTrio, state: ServerState) -> None:
    @app.post("/v1/completions")
    async def completions() -> Response:
        req = await state.parse(CompletionRequest)
        state.check_model(req.model)
        prompts = req.prompts()
        params = req.params()
        state.admit(len(prompts) * req.n)
        token_ids = await state.encode_all(prompts, req.add_special_tokens)
        state.admit(len(prompts) * req.n)  # again: others may have come in meanwhile
        head = response_head(state, f"cmpl-{uuid.uuid4().hex}", "text_completion")
        rids = [f"{head['id']}-{i}" for i in range(len(prompts))]
        streams = await state.start(token_ids, params, rids)
        echoes = [await echo_text(state.engine, p) for p in prompts] if req.echo else None
        shape = CompletionShape(state.engine, req, echoes)
        if req.stream:
            outputs = merged(streams, state.metrics, app.nursery)
            return await sse_response(completion_events(outputs, head, req, shape))
        results = await collect_all(streams, state.metrics, req.n)
        choices = (shape.choice(i, r, results[i - r.index]) for i, r in enumerate(results))
        return await json_in_pieces(choices, head, "choices", {"usage": usage(results)})

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        req = await state.parse(ChatCompletionRequest)
        state.check_model(req.model)
        tools = req.tool_dicts()
        parser, auto = state.settings.tool_call_parser, state.settings.enable_auto_tool_choice
        chosen = tool_choice(tools, req.chosen_tools, req.parallel_tool_calls, parser, auto)
        params = req.params(chosen.grammar)
        state.admit(req.n)
        prompt = await state.chat_prompt(req.conversation(), req.chat_template_kwargs, tools)
        state.admit(req.n)  # again: others may have come in while this one was rendered
        head = response_head(state, f"chatcmpl-{uuid.uuid4().hex}", "chat.completion")
        streams = await state.start([prompt], params, [head["id"]])
        if req.stream:
            head["object"] = "chat.completion.chunk"
            outputs = merged(streams, state.metrics, app.nursery)
            events = chat_events(state.engine, outputs, head, req, chosen.reader)
            return await sse_response(events)
        results = await collect_all(streams, state.metrics, req.n)
        choices = (
            chat_choice(
                "message",
                *assistant_message(chosen.reader, r),
                logprobs=chat_logprobs(state.engine, req, r),
            )
            for r in results
        )
        return await json_in_pieces(choices, head, "choices", {"usage": usage(results)})


def assistant_message(
    reader: ToolCallReader | None, result: Collected
) -> tuple[dict[str, Any], Collected, str | None]:
    """The whole answer's message, the result, and its finish reason: "tool_calls" where
    the model ended after writing calls."""
    if reader is None:
        return {"role": "assistant", "content": result.text}, result, result.finish_reason
    answer = read_calls(reader, result.text)
    message: dict[str, Any] = {"role": "assistant", "content": answer.content}
    if not answer.tool_calls:
        return message, result, result.finish_reason
    message["tool_calls"] = answer.tool_calls
    return message, result, called(result.finish_reason)


def called(finish_reason: str | None) -> str | None:
    """A call ends the answer as "tool_calls" where the model stopped by itself."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


def response_head(state: ServerState, request_id: str, kind: str) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": kind,
        "created": int(time.time()),
        "model": state.settings.served_model_name,
    }


async def echo_text(engine: EngineClient, prompt: str | list[int]) -> str:
    return prompt if isinstance(prompt, str) else await engine.detokenize(prompt)


class CompletionShape:
    """A completion's choices: prompt echoed or not, log-probabilities or not."""

    def __init__(self, engine: EngineClient, req: CompletionRequest, echoes: list[str] | None):
        self.engine = engine
        self.n = req.n
        self.num_top = req.logprobs
        self.echoes = echoes
        self._offsets: dict[int, int] = {}  # streamed text so far, by choice

    def choice(self, index: int, end: Collected | RequestOutput, first: Collected) -> dict:
        """A whole choice; `first` is its prompt's first sample (the one with the prompt's
        log-probabilities)."""
        text = end.text
        logprobs = None
        if self.echoes is not None:
            text = self.echoes[index // self.n] + text
        if self.num_top is not None:
            scored = logprobs_format.generated(end.token_ids, end.logprobs, end.top_logprobs)
            if self.echoes is not None:
                scored = logprobs_format.prompt(first.prompt_logprobs or []) + scored
            logprobs = logprobs_format.completion(self.engine, scored, self.num_top)
        return completion_choice(index, text, end, logprobs)

    def chunk_logprobs(
        self, index: int, out: RequestOutput, echoed: Collected | None
    ) -> dict[str, Any] | None:
        """A streamed piece's log-probabilities (`echoed`: on a choice's first piece, with
        the prompt echoed, its prompt's first sample); offsets go on from the last piece."""
        if self.num_top is None:
            return None
        scored = logprobs_format.generated(out.token_ids, out.logprobs, out.top_logprobs)
        if echoed is not None:
            scored = logprobs_format.prompt(echoed.prompt_logprobs or []) + scored
        offset = self._offsets.get(index, 0)
        logprobs = logprobs_format.completion(self.engine, scored, self.num_top, offset)
        tokens = logprobs["tokens"]
        self._offsets[index] = offset + sum(len(t) for t in tokens)
        return logprobs


def completion_choice(
    index: int, text: str, end: Collected | RequestOutput, logprobs: dict[str, Any] | None
) -> dict[str, Any]:
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": end.finish_reason,
        "stop_reason": end.matched_stop,
    }


def chat_logprobs(
    engine: EngineClient, req: ChatCompletionRequest, result: Collected | RequestOutput
) -> dict[str, Any] | None:
    if not req.logprobs:
        return None
    scored = logprobs_format.generated(result.token_ids, result.logprobs, result.top_logprobs)
    return logprobs_format.chat(engine, scored)


def chat_choice(
    key: Literal["message", "delta"],
    content: dict[str, Any],
    end: Collected | RequestOutput | None = None,
    finish_reason: str | None = None,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
) -> dict[str, Any]:
    """A chat choice: `key` is "message" (whole) or "delta" (a streamed chunk); `end` the
    result or last output that ends it, with `finish_reason`."""
    return {
        "index": end.index if end is not None else index,
        key: content,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": end.matched_stop if end is not None else None,
    }


def usage(results: list[Collected]) -> dict[str, Any]:
    """A prompt counts once, however many samples it had."""
    firsts = [r for r in results if r.index == 0]
    prompt = sum(r.num_prompt_tokens for r in firsts)
    completion = sum(len(r.token_ids) for r in results)
    cached = sum(r.num_cached_tokens for r in firsts)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


async def completion_events(
    outputs: Merged, head: dict[str, Any], req: CompletionRequest, shape: CompletionShape
) -> AsyncIterator[bytes]:
    results: dict[int, Collected] = {}
    chunks = TextChunks(
        head, ',"text":', ',"logprobs":null,"finish_reason":null,"stop_reason":null'
    )
    try:
        async with aclosing(outputs):
            async for i, out in outputs:
                index = i * req.n + out.index
                first = index not in results
                results.setdefault(index, Collected()).add(out)
                text, echoed = out.text, None
                if first and shape.echoes is not None:
                    text, echoed = shape.echoes[i] + text, results.get(i * req.n)
                if out.finished or shape.num_top is not None:
                    logprobs = shape.chunk_logprobs(index, out, echoed)
                    choice = completion_choice(index, text, out, logprobs)
                    if out.finished or text or out.token_ids:
                        yield sse_event(head | {"choices": [choice]})
                elif text:
                    yield chunks.event(index, text)
    except Exception as exc:  # the status line is gone: report in-band, then end the stream
        yield error_event(exc)
    if req.include_usage:
        yield sse_event(head | {"choices": [], "usage": usage(list(results.values()))})
    yield SSE_DONE


async def chat_events(
    engine: EngineClient,
    outputs: Merged,
    head: dict[str, Any],
    req: ChatCompletionRequest,
    reader: ToolCallReader | None,
) -> AsyncIterator[bytes]:
    results = [Collected(index=i) for i in range(req.n)]
    calls = [ToolCallStream(reader) for _ in range(req.n)] if reader is not None else None
    role = {"role": "assistant", "content": ""}  # OpenAI sends the role first, on its own
    for i in range(req.n):
        yield sse_event(head | {"choices": [chat_choice("delta", role, index=i)]})
    chunks = TextChunks(
        head, ',"delta":{"content":', '},"logprobs":null,"finish_reason":null,"stop_reason":null'
    )
    try:
        async with aclosing(outputs):
            async for _, out in outputs:
                result = results[out.index]
                result.add(out)
                logprobs = chat_logprobs(engine, req, out) if out.token_ids else None
                if calls is not None:
                    stream = calls[out.index]
                    delta = tool_delta(stream, result.text, out.finished)
                    if delta or logprobs is not None:
                        choice = chat_choice("delta", delta, logprobs=logprobs, index=out.index)
                        yield sse_event(head | {"choices": [choice]})
                    finish = called(out.finish_reason) if stream.called else out.finish_reason
                elif logprobs is not None:
                    delta = {"content": out.text}
                    choice = chat_choice("delta", delta, logprobs=logprobs, index=out.index)
                    yield sse_event(head | {"choices": [choice]})
                    finish = out.finish_reason
                else:
                    if out.text:
                        yield chunks.event(out.index, out.text)
                    finish = out.finish_reason
                if out.finished:
                    yield sse_event(head | {"choices": [chat_choice("delta", {}, out, finish)]})
    except Exception as exc:
        yield error_event(exc)
    if req.include_usage:
        yield sse_event(head | {"choices": [], "usage": usage(results)})
    yield SSE_DONE


def tool_delta(stream: ToolCallStream, text: str, final: bool) -> dict[str, Any]:
    """The delta of content and tool-call fragments that `text`, the whole text so far,
    adds (empty if nothing can be told yet)."""
    content, deltas = stream.feed(text, final)
    delta: dict[str, Any] = {}
    if content:
        delta["content"] = content
    if deltas:
        delta["tool_calls"] = deltas
    return delta
