"""`EngineClient`: the narrow surface the serving layer (`api/`) may depend on, and its types.

The frontend (`runtime.frontend.engine.Engine`) implements it; `api/` imports nothing else from
`runtime` (a test enforces it), so its tests drive it with a small fake, and another engine
could stand in.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeAlias

from runtime.config.sampling import SamplingParams
from runtime.wire.messages import SchedulerStats, WorkerStats

# The largest tensor dimension update_weights_from_distributed may announce: msgpack carries
# at most 64-bit integers, and the worker checks the real shapes.
MAX_TENSOR_DIM = 2**40

# Tensors by name, as a trainer holds them (torch tensors; typed loosely so that `api/` need
# not import torch).
NamedTensors: TypeAlias = Mapping[str, Any] | Sequence[tuple[str, Any]]

__all__ = [
    "MAX_TENSOR_DIM",
    "EngineClient",
    "EngineDeadError",
    "EngineStats",
    "FrontendStats",
    "ModelCard",
    "NamedTensors",
    "PromptLogprob",
    "RequestOutput",
    "RequestTimeoutError",
    "SamplingParams",
    "SchedulerStats",
    "SessionParams",
    "TopLogprobs",
    "WorkerStats",
]


class EngineDeadError(RuntimeError):
    """The engine stopped (an actor died, or it shut down) while the request was running."""


class RequestTimeoutError(RuntimeError):
    """The request ran past its `timeout`; the engine aborted it."""


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


class EngineClient(Protocol):
    @property
    def model_card(self) -> ModelCard: ...

    def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        rid: str | None = None,
        timeout: float | None = None,
        session: SessionParams | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Validate now (ValueError on bad input); the request is queued once iterated.

        Leaving the iteration early, or cancelling the iterating task, aborts the request.
        `rid` is the caller's label for the request (outputs carry it, `abort` takes it): it
        must not be the label of a request still open (ValueError, now or as the iteration
        starts) and is free again as soon as that request has ended. The engine keys its own
        state by ids it makes itself. With a `timeout` (seconds from the first iteration), a
        request still running then is aborted and the iterator raises RequestTimeoutError.
        With a `session`, the prompt continues that session's history (its KV reused).
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

    @property
    def is_paused(self) -> bool: ...

    async def pause(self, mode: str = "abort") -> None:
        """Stop generating until `resume`; requests that arrive meanwhile wait, in order.
        `mode`: "abort" (open requests end now, with their output so far), "wait" (they
        finish first) or "keep" (they freeze, KV kept, and continue on resume). ValueError
        for another mode, or if already paused."""
        ...

    async def resume(self) -> None:
        """Continue after `pause`; a no-op if not paused."""
        ...

    async def flush_cache(self) -> None:
        """Drop the prefix cache. ValueError (naming the counts) while any request is open."""
        ...

    async def update_weights_from_disk(
        self, model_path: str, **options: Any
    ) -> tuple[bool, str, int]:
        """Serve another checkpoint's weights: (success, message, requests open meanwhile).
        Options: `weight_version`, `flush_cache` (default True), `abort_all_requests`."""
        ...

    async def update_weights_from_tensor(
        self, tensors: NamedTensors | Path, **options: Any
    ) -> tuple[bool, str]:
        """Install named tensors over the served weights (some or all; checkpoint names):
        a mapping or pairs of name and torch tensor, or the path of a safetensors file. As
        `update_weights_from_disk`; options `weight_version`, `flush_cache`."""
        ...

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str | None = None,
    ) -> tuple[bool, str]:
        """Join a trainer's torch.distributed world (the trainer is rank 0) as `rank_offset`;
        `backend` "gloo" or "nccl" (default: nccl on CUDA, gloo on CPU)."""
        ...

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str,
        **options: Any,
    ) -> tuple[bool, str]:
        """Receive one broadcast per named tensor from the trainer, then install them all as
        `update_weights_from_disk` does; options `weight_version`, `flush_cache`,
        `abort_all_requests`."""
        ...

    async def destroy_weights_update_group(self, group_name: str) -> tuple[bool, str]: ...

    @property
    def is_sleeping(self) -> bool: ...

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Free the KV pool and/or the weights (tags "kv_cache", "weights"; default both);
        generation waits until `resume_memory_occupation`. ValueError while requests run."""
        ...

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None: ...

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[float]:
        """The first values of a parameter (flattened), to check an update; ValueError if the
        model has no such parameter."""
        ...

    def open_session(
        self,
        capacity_of_str_len: int,
        session_id: str | None = None,
        timeout: float | None = None,
    ) -> str:
        """Open a session (its id: the given one, or a new one); ValueError if that id is
        open already or too many sessions are. `timeout`: idle seconds before it closes."""
        ...

    def close_session(self, session_id: str) -> None:
        """Close a session and release its KV; ValueError if it is not open."""
        ...

    async def start_profile(
        self,
        output_dir: str,
        num_steps: int | None = None,
        activities: Sequence[str] = ("CPU",),
        record_shapes: bool = False,
        with_stack: bool = False,
    ) -> None:
        """Trace every actor's steps (the worker's with torch.profiler) as Chrome trace files
        in `output_dir`, until `stop_profile` or for `num_steps` steps; ValueError if a
        profile runs."""
        ...

    async def stop_profile(self) -> None:
        """Stop profiling once every trace is written; ValueError if none runs."""
        ...

    def get_loads(self) -> list[dict[str, Any]]:
        """The load of each data-parallel group, as SGLang's `/v1/loads` entries (what
        routers read), by `dp_rank`."""
        ...

    def get_internal_state(self) -> list[dict[str, Any]]:
        """SGLang's `internal_states`, one per data-parallel group: `last_gen_throughput`,
        `#running`..."""
        ...

    def server_info(self) -> dict[str, Any]:
        """The engine's settings as it runs them (JSON values): its configuration, with what
        the actors reported (KV blocks, dtype, threads) and the live `max_num_seqs`."""
        ...

    async def set_internal_state(self, settings: Mapping[str, Any]) -> None:
        """Change settings live: only `max_num_seqs` (SGLang: `max_running_requests`);
        ValueError naming any other, or a bad value, and then nothing changes."""
        ...

    async def check_health(self) -> None:
        """Return once every actor has answered; callers put a deadline around it."""
        ...

    async def diagnose(self) -> str:
        """After a health check ran past its deadline: which actor is not answering."""
        ...

    def statistics(self) -> EngineStats:
        """The latest known statistics, without waiting."""
        ...

    async def fetch_statistics(self) -> EngineStats:
        """Fresh statistics, reflecting everything submitted before the call."""
        ...

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text (ValueError if it cannot be text, or cannot fit the context).

        Async: a long text is tokenized off the event loop. Serving layers tokenize prompts
        with it and hand `generate` the ids.
        """
        ...

    async def detokenize(self, token_ids: Sequence[int]) -> str: ...

    def token_texts(self, token_ids: Sequence[int]) -> list[str]:
        """Each token's own text, decoded alone, as log-probabilities name tokens ("" for a
        token that is only part of a character, as vLLM does)."""
        ...

    def token_bytes(self, token_ids: Sequence[int]) -> list[bytes]:
        """Each token's own bytes, a part of a character too (OpenAI's logprobs `bytes`)."""
        ...

    async def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        """Render a conversation with the model's chat template, ready to generate the reply."""
        ...
