"""Per-request output buffer between the frontend's dispatch loop and the request's task.

The dispatch loop must never wait on a slow consumer, so `push` is synchronous and only appends.
A consumer that lags simply finds several tokens merged into its next output. Memory stays
bounded by the request's `max_tokens`.

The samples of one call (`n` > 1) are one stream each and share a `Signal`, so the task that
serves them all wakes when any of them has something.
"""

from __future__ import annotations

from dataclasses import dataclass

import trio

from runtime.wire.messages import Logprobs, StepOutputs


class Signal:
    """A wake-up that can be waited for again and again (an event renewed after each wait)."""

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = trio.Event()

    def set(self) -> None:
        self._event.set()

    async def wait(self) -> None:
        await self._event.wait()
        self._event = trio.Event()


@dataclass(frozen=True, slots=True)
class TokenOutput:
    """Tokens as the scheduler reported them, before the frontend adds text."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    num_cached_tokens: int
    top: list[Logprobs | None] | None = None  # by token, if the request asked for them
    prompt: Logprobs | None = None  # with the first token, if the request asked for them
    embedding: bytes | None = None  # an embedding request's vector, with its end


class RequestStream:
    """Tokens for one request, pushed by the dispatch loop and taken by the request's task.

    `upstream_done` becomes True once the scheduler has nothing more for this request: it
    finished it, or we sent it an abort. It guards the rule of exactly one abort per request.
    """

    __slots__ = (
        "_embedding",
        "_error",
        "_finish_reason",
        "_logprobs",
        "_prompt",
        "_taken_end",
        "_token_ids",
        "_top",
        "num_cached_tokens",
        "signal",
        "upstream_done",
    )

    def __init__(self, signal: Signal | None = None) -> None:
        self.signal = signal or Signal()
        self.num_cached_tokens = 0
        self.upstream_done = False
        self._token_ids: list[int] = []
        self._logprobs: list[float] = []
        self._top: list[Logprobs | None] | None = None
        self._prompt: Logprobs | None = None
        self._embedding: bytes | None = None
        self._finish_reason: str | None = None
        self._error: BaseException | None = None
        self._taken_end = False  # the end was handed to the consumer

    @property
    def finished(self) -> bool:
        return self._finish_reason is not None or self._error is not None

    @property
    def ready(self) -> bool:
        """`take` has something: tokens, or an end not taken yet."""
        return bool(self._token_ids) or (self.finished and not self._taken_end)

    def push(
        self,
        token_id: int,
        logprob: float,
        finish_reason: str | None,
        cached: int,
        top: Logprobs | None = None,
        prompt: Logprobs | None = None,
    ) -> None:
        if self._finish_reason is not None:
            return  # ended locally (abort) while this step ran
        self._token_ids.append(token_id)
        self._logprobs.append(logprob)
        if top is not None:
            if self._top is None:
                self._top = [None] * (len(self._token_ids) - 1)
            self._top.append(top)
        elif self._top is not None:
            self._top.append(None)
        if prompt is not None:
            self._prompt = prompt
        self._finish_reason = finish_reason
        self.upstream_done = finish_reason is not None
        self.num_cached_tokens = cached
        self.signal.set()

    def push_embedding(self, vector: bytes, cached: int) -> None:
        """An embedding request's vector: its one output, and its end."""
        if self._finish_reason is not None:
            return  # ended locally (abort) while this step ran
        self._embedding = vector
        self._finish_reason = "stop"
        self.upstream_done = True
        self.num_cached_tokens = cached
        self.signal.set()

    @property
    def consumed(self) -> bool:
        """Its end was handed to the consumer: nothing more will come out of it."""
        return self.finished and self._taken_end

    def end(self, finish_reason: str, *, taken: bool = False) -> None:
        """Finish the request here, whatever the scheduler still sends; `taken`: the consumer
        decided it (a stop string) and already has its last output."""
        if not self.finished:
            self._finish_reason = finish_reason
            self._taken_end = taken
            self.signal.set()

    def fail(self, error: BaseException) -> None:
        if not self.finished:
            self._error = error
            self.signal.set()

    def take(self) -> TokenOutput:
        """Everything pending (call when `ready`); raises the stream's error if it failed."""
        if self._error is not None:
            self._taken_end = True
            raise self._error
        token_ids, self._token_ids = self._token_ids, []
        logprobs, self._logprobs = self._logprobs, []
        top, self._top = self._top, None
        prompt, self._prompt = self._prompt, None
        embedding, self._embedding = self._embedding, None
        self._taken_end = self.finished
        return TokenOutput(
            token_ids, logprobs, self._finish_reason, self.num_cached_tokens, top, prompt,
            embedding,
        )  # fmt: skip

    async def next_output(self) -> TokenOutput:
        """Wait for new tokens (or the end) and take everything pending."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while not self.ready:
            await self.signal.wait()
        return self.take()


def dispatch(streams: dict[str, RequestStream], msg: StepOutputs) -> None:
    """Hand each request its token from one step. Never waits: a slow consumer just gets
    tokens merged. A request no longer in `streams` was abandoned while the step ran."""
    if msg.embeddings:  # some embedding requests ended: they take a vector, not a token
        _dispatch_embeddings(streams, msg)
        return
    if msg.top or msg.prompt:  # some request asked for log-probabilities
        none = (None,) * len(msg.rids)
        for rid, token_id, logprob, reason, cached, top, prompt in zip(
            msg.rids,
            msg.token_ids,
            msg.logprobs,
            msg.finish_reasons,
            msg.num_cached_tokens,
            msg.top or none,
            msg.prompt or none,
            strict=True,
        ):
            stream = streams.get(rid)
            if stream is not None:
                stream.push(token_id, logprob, reason, cached, top, prompt)
        return
    for rid, token_id, logprob, reason, cached in zip(
        msg.rids,
        msg.token_ids,
        msg.logprobs,
        msg.finish_reasons,
        msg.num_cached_tokens,
        strict=True,
    ):
        stream = streams.get(rid)
        if stream is not None:
            stream.push(token_id, logprob, reason, cached)


def _dispatch_embeddings(streams: dict[str, RequestStream], msg: StepOutputs) -> None:
    none = (None,) * len(msg.rids)
    for rid, token_id, logprob, reason, cached, top, prompt, vector in zip(
        msg.rids,
        msg.token_ids,
        msg.logprobs,
        msg.finish_reasons,
        msg.num_cached_tokens,
        msg.top or none,
        msg.prompt or none,
        msg.embeddings,
        strict=True,
    ):
        stream = streams.get(rid)
        if stream is None:
            continue
        if vector is not None:
            stream.push_embedding(vector, cached)
        else:
            stream.push(token_id, logprob, reason, cached, top, prompt)
