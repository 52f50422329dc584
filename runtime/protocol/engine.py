"""`EngineClient`: the request protocol, what the request routes of `api/` use."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping, Sequence
from typing import Any, Protocol

from runtime.config.constraint import Constraint
from runtime.config.pooling import PoolingParams
from runtime.config.sampling import SamplingParams
from runtime.protocol.control import ControlClient, WeightsClient
from runtime.protocol.types import (
    Embedding,
    EngineStats,
    ModelCard,
    RequestOutput,
    SessionParams,
)


class EngineClient(Protocol):
    """Requests, their text, sessions, and what the engine reports of itself."""

    control: ControlClient  # the engine's control part (pause, memory, profiles)
    weights: WeightsClient  # the engine's weights part (updates, reads, version)

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

    async def compile_constraint(self, constraint: Constraint) -> None:
        """Check a structured-output constraint by compiling it, off the event loop:
        ValueError naming what is wrong (invalid, too large, too slow to compile). `generate`
        compiles its request's constraint too as its iteration starts; a server calls this
        first, to answer 400 before it streams. Verdicts are cached: the second is free."""
        ...

    async def embed(
        self,
        inputs: Sequence[str | Sequence[int]],
        params: PoolingParams | None = None,
        *,
        add_special_tokens: bool = True,
        rid: str | None = None,
    ) -> list[Embedding]:
        """One vector per input (a text, or token ids), in input order: each input is a
        prefill-only request, batched with everything else the engine runs, its blocks
        freed once its vector is pooled (the prefix cache may serve "last" pooling's).

        Bad input raises FieldError naming the field (`inputs[i]`, `dimensions`,
        `truncate_prompt_tokens`, `pooling_type`) before anything is queued. Cancelling the
        calling task (a deadline, too: `trio.fail_after`) aborts every input; so does
        `abort(rid)` (or `abort_all`), and then the call raises RequestAbortedError.
        """
        ...

    def abort(self, rid: str) -> bool:
        """End a request now: its iterator yields a final output with finish_reason "abort".
        False if no open request has that rid."""
        ...

    def abort_all(self) -> int:
        """Abort every open request (a server's drain deadline); how many there were."""
        ...

    async def wait_no_requests(self) -> None:
        """Return once no request is open."""
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

    async def check_health(self) -> str:
        """Return once every actor has answered ("" then), or, while a long control call
        runs (a weight update), once the scheduler has (naming the call); callers put a
        deadline around it."""
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

    async def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        template_kwargs: Mapping[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """Render a conversation with the model's chat template, ready to generate the reply;
        `template_kwargs`: variables the template reads (e.g. `enable_thinking`); `tools`:
        OpenAI's function tools, which the template lists. ValueError if the template rejects
        them, or has no place for tools."""
        ...
