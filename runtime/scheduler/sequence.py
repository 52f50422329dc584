"""A request as the scheduler sees it: token ids, counters, a block table and a status."""

from __future__ import annotations

import enum

from runtime.config.pooling import PoolingParams
from runtime.config.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    HELD = "held"  # arrived while the scheduler was paused: admitted on resume
    FORKING = "forking"  # a sample of n > 1 waiting for its first sibling's prompt KV
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Counters plus derived properties; nothing stored that can be computed.

    The scheduler's view is optimistic: scheduling a step at once extends `num_computed_tokens`
    (the tokens whose KV the cache will hold once every step sent so far has run) and, when that
    reaches the end of the sequence, counts one more *pending* token: sampled by a step in
    flight, its value arrives with that step's result. So the next step can be planned before the
    previous one returns.
    """

    __slots__ = (
        "block_table",
        "cacheable",
        "finish_reason",
        "fork_parent",
        "forks",
        "max_tokens",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_pending_tokens",
        "num_prompt_tokens",
        "params",
        "pooling",
        "rid",
        "seq_id",
        "session",
        "status",
        "stop_token_ids",
        "token_ids",
    )

    def __init__(
        self,
        seq_id: int,
        rid: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        max_tokens: int,
        session: str = "",
        pooling: PoolingParams | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("a prompt needs at least one token")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        self.seq_id = seq_id
        self.rid = rid
        self.session = session  # "" if none: else its KV is kept for the session when it ends
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.pooling = pooling  # an embedding: its prompt is pooled, nothing is sampled
        self.max_tokens = max_tokens  # resolved by the frontend: never None here
        self.stop_token_ids = frozenset(params.stop_token_ids)  # checked for every token
        self.num_computed_tokens = 0
        self.num_pending_tokens = 0  # sampled by steps in flight, values not known yet
        self.num_cached_tokens = -1  # prompt tokens from the prefix cache; -1 until admitted
        self.block_table: list[int] = []
        self.cacheable = True  # False once its KV mixes weights (a flush while it held blocks)
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.forks: list[Sequence] = []  # FORKING siblings that will share our prompt's KV
        self.fork_parent: Sequence | None = None  # while FORKING: whose prompt we wait for

    @property
    def max_cached_tokens(self) -> int:
        """Prompt tokens the prefix cache may supply: not those whose logits the request wants
        (prompt log-probabilities score each token with the logits before it), nor any whose
        hidden state an embedding pools (the cache holds keys and values, not those)."""
        if self.pooling is not None and self.pooling.reads_every_token:
            return 0
        params = self.params
        if params.prompt_logprobs is None or len(self.token_ids) > self.num_prompt_tokens:
            return len(self.token_ids)
        return max(params.prompt_logprobs_start, 1) - 1

    @property
    def num_tokens(self) -> int:
        """Known and pending tokens."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens, pending ones included."""
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id}, {self.rid!r}, {self.status.value}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"blocks={self.block_table})"
        )
