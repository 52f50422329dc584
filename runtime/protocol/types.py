"""The types the engine and its clients share: outputs, statistics, errors, parameters."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from runtime.wire.stats import SchedulerStats, WorkerStats

# The largest tensor dimension update_weights_from_distributed may announce: msgpack carries
# at most 64-bit integers, and the worker checks the real shapes.
MAX_TENSOR_DIM = 2**40

# Tensors by name, as a trainer holds them (torch tensors; typed loosely so that `api/` need
# not import torch).
NamedTensors: TypeAlias = Mapping[str, Any] | Sequence[tuple[str, Any]]


class EngineDeadError(RuntimeError):
    """The engine stopped (an actor died, or it shut down) while the request was running."""


class RequestTimeoutError(RuntimeError):
    """The request ran past its `timeout`; the engine aborted it."""


class RequestAbortedError(RuntimeError):
    """The call was aborted (`abort`, a pause in mode abort, a drain's deadline) before it
    had its whole result: an embedding has no partial one to return."""


@dataclass(frozen=True, slots=True)
class Embedding:
    """One input's vector, from `EngineClient.embed`.

    Attributes:
        index: the input's position among the call's inputs.
        data: the vector as little-endian float32 bytes (what OpenAI's base64 form encodes).
        num_prompt_tokens: the input's tokens (after any truncation).
        num_cached_tokens: of them, those whose KV the prefix cache supplied.
    """

    index: int
    data: bytes
    num_prompt_tokens: int
    num_cached_tokens: int

    @property
    def embedding(self) -> list[float]:
        """The vector's values (float32 values, as Python floats)."""
        values = array("f")
        values.frombytes(self.data)
        if sys.byteorder == "big":
            values.byteswap()
        return values.tolist()


@dataclass(frozen=True, slots=True)
class ModelCard:
    """What a client may learn about the served model."""

    path: str
    max_model_len: int
    vocab_size: int
    weight_version: str = "default"  # changes with each weight update


# The most likely tokens at one position, most likely first: (token id, log-probability).
TopLogprobs: TypeAlias = tuple[tuple[int, float], ...]


@dataclass(frozen=True, slots=True)
class PromptLogprob:
    """A prompt token's log-probability given the tokens before it (None for the first
    token, which nothing scores), with the most likely tokens at its position."""

    token_id: int
    logprob: float | None
    top: TopLogprobs | None


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one request produced since its previous output.

    Attributes:
        rid: the request id.
        index: which of the request's `n` samples this output belongs to.
        token_ids: tokens generated since the last output (none only on a final output).
        logprobs: log-probability of each of those tokens under the model.
        text: the text those tokens add (stop strings and stop tokens excluded).
        finish_reason: None while running; "stop", "length" or "abort" on the last output.
        matched_stop: the stop string or stop token id that ended the request, if any.
        num_prompt_tokens: prompt length in tokens.
        num_cached_tokens: prompt tokens served from the prefix cache.
        top_logprobs: with `SamplingParams.logprobs`, the most likely tokens at the position
            of each token of `token_ids`; else None.
        prompt_logprobs: with `SamplingParams.prompt_logprobs`, on the sample's first output:
            one entry per prompt position from `prompt_logprobs_start` on; else None.
    """

    rid: str
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str | None
    matched_stop: str | int | None
    num_prompt_tokens: int
    num_cached_tokens: int
    index: int = 0
    top_logprobs: list[TopLogprobs] | None = None
    prompt_logprobs: list[PromptLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class FrontendStats:
    """The frontend's own figures."""

    num_requests_open: int
    """Requests whose `generate` is still being iterated."""
    num_requests_generating: int
    """Open requests the actors still work on; the others have all their output, and wait for
    their reader to take it (a client that stopped reading holds no engine capacity)."""
    prompt_tokens_total: int
    """Prompt tokens of every request submitted so far."""
    dispatch_seconds: float
    """Handing each step's tokens to their requests, in total."""
    detokenize_seconds: float
    """Turning tokens into text and matching stop strings, in total."""


@dataclass(frozen=True, slots=True)
class RankStats:
    """One data-parallel group's figures."""

    dp_rank: int
    scheduler: SchedulerStats
    worker: WorkerStats
    prompt_tokens_total: int
    """Prompt tokens of the requests sent to this group."""


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The frontend's figures and the latest each actor reported. Every step's outputs carry
    the actors' figures, and they send a last report when they come to rest, so at rest this
    snapshot is exact. With data parallelism, `scheduler` and `worker` add up every group's
    figures, and `ranks` has each group's own."""

    frontend: FrontendStats
    scheduler: SchedulerStats
    worker: WorkerStats
    ranks: tuple[RankStats, ...] = ()

    def per_rank(self) -> tuple[RankStats, ...]:
        """Each data-parallel group's figures (one group: the engine's own)."""
        if self.ranks:
            return self.ranks
        prompts = self.frontend.prompt_tokens_total
        return (RankStats(0, self.scheduler, self.worker, prompts),)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks held by sequences, 0 to 1."""
        s = self.scheduler
        used = s.num_total_blocks - s.num_free_blocks
        return used / s.num_total_blocks if s.num_total_blocks else 0.0


@dataclass(frozen=True, slots=True)
class SessionParams:
    """Which session a request continues, and from where (runtime/frontend/sessions.py)."""

    id: str
    rid: str | None = None
    offset: int | None = None
    replace: bool = False
    drop_previous_output: bool = False
