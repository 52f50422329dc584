"""Per-request output buffer between the frontend's dispatch loop and the request's task.

The dispatch loop must never wait on a slow consumer, so `push` is synchronous and only appends.
A consumer that lags simply finds several tokens merged into its next output. Memory stays
bounded by the request's `max_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass

import trio


@dataclass(frozen=True, slots=True)
class TokenOutput:
    """Tokens as the scheduler reported them, before the frontend adds text."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    num_cached_tokens: int


class RequestStream:
    """Tokens for one request, pushed by the dispatch loop and taken by the request's task.

    `upstream_done` becomes True once the scheduler has nothing more for this request: it
    finished it, or we sent it an abort. It guards the rule of exactly one abort per request.
    """

    __slots__ = (
        "_error",
        "_finish_reason",
        "_logprobs",
        "_token_ids",
        "_wakeup",
        "num_cached_tokens",
        "upstream_done",
    )

    def __init__(self) -> None:
        self.num_cached_tokens = 0
        self.upstream_done = False
        self._token_ids: list[int] = []
        self._logprobs: list[float] = []
        self._finish_reason: str | None = None
        self._error: BaseException | None = None
        self._wakeup = trio.Event()

    @property
    def finished(self) -> bool:
        return self._finish_reason is not None or self._error is not None

    def push(self, token_id: int, logprob: float, finish_reason: str | None, cached: int) -> None:
        if self._finish_reason is not None:
            return  # ended locally (abort) while this step ran
        self._token_ids.append(token_id)
        self._logprobs.append(logprob)
        self._finish_reason = finish_reason
        self.upstream_done = finish_reason is not None
        self.num_cached_tokens = cached
        self._wakeup.set()

    def end(self, finish_reason: str) -> None:
        """Finish the request here, whatever the scheduler still sends."""
        if not self.finished:
            self._finish_reason = finish_reason
            self._wakeup.set()

    def fail(self, error: BaseException) -> None:
        if not self.finished:
            self._error = error
            self._wakeup.set()

    async def next_output(self) -> TokenOutput:
        """Wait for new tokens (or the end) and take everything pending."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while not self._token_ids and not self.finished:
            await self._wakeup.wait()
            self._wakeup = trio.Event()
        if self._error is not None:
            raise self._error
        token_ids, self._token_ids = self._token_ids, []
        logprobs, self._logprobs = self._logprobs, []
        return TokenOutput(token_ids, logprobs, self._finish_reason, self.num_cached_tokens)
