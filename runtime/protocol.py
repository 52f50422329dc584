"""`EngineClient`: the narrow surface the serving layer (`api/`) may depend on.

The frontend (`runtime.engine.Engine`) implements it; `api/` only ever types against this
protocol, so its tests drive it with a small fake, and another engine could stand in.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Protocol

from runtime.messages import SchedulerStats
from runtime.request_stream import RequestOutput
from runtime.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class ModelCard:
    """What a client may learn about the served model."""

    path: str
    max_model_len: int
    vocab_size: int


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine, as of the scheduler's latest message.

    Attributes:
        num_requests_running: sequences in the running batch.
        num_requests_waiting: sequences queued (new or preempted).
        num_requests_open: requests whose `generate` is still being iterated.
        kv_cache_usage: fraction of KV blocks held by sequences, 0 to 1.
        prompt_tokens_total: prompt tokens of all requests submitted so far.
        generation_tokens_total: tokens generated so far.
        dispatch_seconds: frontend time handing step outputs to requests, in total.
        detokenize_seconds: frontend time turning tokens into text (and stop strings).
        scheduler: the scheduler's full counters (steps, timings, preemptions...).
    """

    num_requests_running: int
    num_requests_waiting: int
    num_requests_open: int
    kv_cache_usage: float
    prompt_tokens_total: int
    generation_tokens_total: int
    dispatch_seconds: float
    detokenize_seconds: float
    scheduler: SchedulerStats


class EngineClient(Protocol):
    @property
    def model_card(self) -> ModelCard: ...

    def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        rid: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Validate now (ValueError on bad input); the request is queued once iterated.

        Leaving the iteration early, or cancelling the iterating task, aborts the request.
        """
        ...

    def abort(self, rid: str) -> None:
        """End a request now: its iterator yields a final output with finish_reason "abort"."""
        ...

    def abort_all(self) -> None:
        """Abort every open request (a server's drain deadline)."""
        ...

    async def wait_no_requests(self) -> None:
        """Return once no request is open."""
        ...

    async def check_health(self) -> None:
        """Return once every actor has answered; callers put a deadline around it."""
        ...

    def statistics(self) -> EngineStats:
        """The latest known statistics, without waiting."""
        ...

    async def fetch_statistics(self) -> EngineStats:
        """Fresh statistics, reflecting everything submitted before the call."""
        ...

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def detokenize(self, token_ids: Sequence[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        """Render a conversation with the model's chat template, ready to generate the reply."""
        ...
