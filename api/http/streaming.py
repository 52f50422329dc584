"""Running requests for a handler: collect them whole, or stream them as server-sent events.

A client that disconnects mid-stream makes hypercorn cancel the response; the generators here
are closed (`aclosing`), which closes the engine's iterator, which aborts the request.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Iterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import trio
from quart import Response, make_response

from api.http.errors import APIError, engine_stopped, timed_out
from api.http.metrics import Metrics
from runtime.protocol import (
    EngineDeadError,
    PromptLogprob,
    RequestOutput,
    RequestTimeoutError,
    TopLogprobs,
)

SSE_DONE = b"data: [DONE]\n\n"
INLINE_ANSWER = 256 * 2**10  # bytes of a JSON answer sent whole; a larger one, in pieces

Merged = AsyncGenerator[tuple[int, RequestOutput], None]  # (choice index, output): `merged`


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class TextChunks:
    """SSE events that differ only in their choice index and text, built without a dict.

    Every token of a stream becomes one such event, so the rest of it is encoded once per
    request: `head` (id, object, created, model), then `choices` with `before` + the text +
    `after`. The result is the JSON that `sse_event` would produce for the same fields.
    """

    def __init__(self, head: dict[str, Any], before: str, after: str) -> None:
        head_json = json.dumps(head, separators=(",", ":"))
        self._prefix = f'data: {head_json[:-1]},"choices":[{{"index":'.encode()
        self._before = before.encode()
        self._after = f"{after}}}]}}\n\n".encode()

    def event(self, index: int, text: str) -> bytes:
        return b"".join(
            (
                self._prefix,
                str(index).encode(),
                self._before,
                json.dumps(text).encode(),
                self._after,
            )
        )


async def sse_response(events: AsyncIterator[bytes]) -> Response:
    response = await make_response(
        events,
        200,
        {
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
        },
    )
    assert isinstance(response, Response)
    response.timeout = None  # Quart's 60 s RESPONSE_TIMEOUT would cut long streams
    return response


async def json_in_pieces(
    items: Iterable[Any],
    head: dict[str, Any] | None = None,
    key: str = "choices",
    tail: dict[str, Any] | None = None,
) -> Response:
    """A JSON answer built one list item at a time, the loop let go between items: `head`'s
    keys, then `key` with the list of `items`, then `tail`'s keys (or, with no `head`, just
    the list). An answer with prompts echoed and their log-probabilities can be megabytes:
    this way it holds the loop no longer than its largest item (a choice) does, and past
    INLINE_ANSWER bytes it is sent in pieces as they are built (chunked) instead of whole."""
    pieces = _json_pieces(items, head, key, tail)
    built: list[bytes] = []
    size = 0
    for piece in pieces:
        built.append(piece)
        size += len(piece)
        await trio.lowlevel.checkpoint()
        if size > INLINE_ANSWER:

            async def the_rest() -> AsyncIterator[bytes]:
                yield b"".join(built)
                for piece in pieces:
                    yield piece
                    await trio.lowlevel.checkpoint()

            return Response(the_rest(), 200, {"Content-Type": "application/json"})
    return Response(b"".join(built), 200, {"Content-Type": "application/json"})


def _json_pieces(
    items: Iterable[Any], head: dict[str, Any] | None, key: str, tail: dict[str, Any] | None
) -> Iterator[bytes]:
    if head is not None:
        yield _dumps(head)[:-1] + (b"," if head else b"") + _dumps(key) + b":"
    yield b"["
    for i, item in enumerate(items):
        yield (b"," if i else b"") + _dumps(item)
    yield b"]"
    if head is not None:
        yield b"," + _dumps(tail)[1:] if tail else b"}"


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


@dataclass(slots=True)
class Collected:
    """One sample of a finished request, whole."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] | None = None
    prompt_logprobs: list[PromptLogprob] | None = None
    finish_reason: str | None = None
    matched_stop: str | int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    index: int = 0  # which of the request's samples

    def add(self, out: RequestOutput) -> None:
        self.text += out.text
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs
        if out.top_logprobs is not None:
            if self.top_logprobs is None:
                self.top_logprobs = []
            self.top_logprobs += out.top_logprobs
        self.prompt_logprobs = self.prompt_logprobs or out.prompt_logprobs
        self.finish_reason = out.finish_reason
        self.matched_stop = out.matched_stop
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_cached_tokens = out.num_cached_tokens
        self.index = out.index


async def timed(
    stream: AsyncGenerator[RequestOutput, None], metrics: Metrics
) -> AsyncGenerator[RequestOutput, None]:
    """The request's outputs, observed by the latency metrics as they pass.

    A request the engine refuses once started (its id taken meanwhile by another request) is a
    400 too, like one it refuses at once.
    """
    timer = metrics.timer()
    async with aclosing(stream) as outputs:
        try:
            async for out in outputs:
                timer.tokens(len(out.token_ids))
                yield out
        except ValueError as exc:
            raise APIError(400, str(exc), code="invalid_value") from None
    timer.finish()


async def collect_all(
    streams: list[AsyncGenerator[RequestOutput, None]], metrics: Metrics, n: int = 1
) -> list[Collected]:
    """Run every request to its end, concurrently: its `n` samples each, request by request."""
    results = [Collected(index=i % n) for i in range(len(streams) * n)]

    async def run(i: int) -> None:
        async with aclosing(timed(streams[i], metrics)) as outputs:
            async for out in outputs:
                results[i * n + out.index].add(out)

    async with trio.open_nursery() as nursery:
        for i in range(len(streams)):
            nursery.start_soon(run, i)
    return results


async def merged(
    streams: list[AsyncGenerator[RequestOutput, None]], metrics: Metrics, nursery: trio.Nursery
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """(choice index, output) as each request produces them, with latency metrics.

    Several requests run as producer tasks in the app's nursery (a generator must not yield
    inside a nursery of its own); closing this generator cancels them, which aborts them.
    """
    if len(streams) == 1:
        async with aclosing(timed(streams[0], metrics)) as outputs:
            async for out in outputs:
                yield 0, out
        return
    send, receive = trio.open_memory_channel[tuple[int, RequestOutput | Exception]](math.inf)
    scopes = [trio.CancelScope() for _ in streams]
    for i, stream in enumerate(streams):
        nursery.start_soon(_produce, i, timed(stream, metrics), send.clone(), scopes[i])
    send.close()
    try:
        async with receive:
            async for i, item in receive:
                if isinstance(item, Exception):
                    raise item
                yield i, item
    finally:
        for scope in scopes:
            scope.cancel()


async def _produce(
    i: int,
    stream: AsyncGenerator[RequestOutput, None],
    send: trio.MemorySendChannel[tuple[int, RequestOutput | Exception]],
    scope: trio.CancelScope,
) -> None:
    with scope, contextlib.suppress(trio.BrokenResourceError):  # the consumer left: we stop
        async with send, aclosing(stream) as outputs:
            try:
                async for out in outputs:
                    send.send_nowait((i, out))  # unbounded, but never more than max_tokens
            except Exception as exc:  # hand it to the consumer: the app nursery must not die
                send.send_nowait((i, exc))


def error_event(exc: Exception) -> bytes:
    """An in-band error for a stream whose 200 status is already sent."""
    if isinstance(exc, APIError):
        error = exc
    elif isinstance(exc, EngineDeadError):
        error = engine_stopped(exc)
    elif isinstance(exc, RequestTimeoutError):
        error = timed_out(exc)
    else:
        error = APIError(500, str(exc) or type(exc).__name__)
    return sse_event(error.body())
