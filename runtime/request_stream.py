"""Per-request output buffer between the frontend's dispatch loop and the request's task.

The dispatch loop must never wait on a slow consumer, so `push` is synchronous and only appends.
A consumer that lags simply finds several tokens merged into its next output. Memory stays
bounded by the request's `max_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass

import trio


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """New tokens of one request since its previous output.

    Attributes:
        rid: the request id.
        token_ids: tokens generated since the last output (at least one, unless finished).
        logprobs: log-probability of each of those tokens under the model.
        finish_reason: None while running; "stop", "length" or "abort" on the last output.
        num_prompt_tokens: prompt length in tokens.
        num_cached_tokens: prompt tokens served from the prefix cache.
    """

    rid: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineDeadError(RuntimeError):
    """The engine stopped (an actor died, or it shut down) while the request was running."""


class RequestStream:
    __slots__ = (
        "_error",
        "_finish_reason",
        "_logprobs",
        "_token_ids",
        "_wakeup",
        "num_cached_tokens",
        "num_prompt_tokens",
        "rid",
    )

    def __init__(self, rid: str, num_prompt_tokens: int) -> None:
        self.rid = rid
        self.num_prompt_tokens = num_prompt_tokens
        self.num_cached_tokens = 0
        self._token_ids: list[int] = []
        self._logprobs: list[float] = []
        self._finish_reason: str | None = None
        self._error: BaseException | None = None
        self._wakeup = trio.Event()

    @property
    def finished(self) -> bool:
        return self._finish_reason is not None or self._error is not None

    def push(self, token_id: int, logprob: float, finish_reason: str | None, cached: int) -> None:
        self._token_ids.append(token_id)
        self._logprobs.append(logprob)
        self._finish_reason = finish_reason
        self.num_cached_tokens = cached
        self._wakeup.set()

    def fail(self, error: BaseException) -> None:
        if not self.finished:
            self._error = error
            self._wakeup.set()

    async def next_output(self) -> RequestOutput:
        """Wait for new tokens (or the end) and take everything pending."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while not self._token_ids and not self.finished:
            await self._wakeup.wait()
            self._wakeup = trio.Event()
        if self._error is not None:
            raise self._error
        token_ids, self._token_ids = self._token_ids, []
        logprobs, self._logprobs = self._logprobs, []
        return RequestOutput(
            self.rid,
            token_ids,
            logprobs,
            self._finish_reason,
            self.num_prompt_tokens,
            self.num_cached_tokens,
        )
