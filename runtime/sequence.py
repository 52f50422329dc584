"""A request as the scheduler sees it: token ids, counters, a block table and a status."""

from __future__ import annotations

import enum

from runtime.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Counters plus derived properties; nothing stored that can be computed.

    Tokens `[0, num_computed_tokens)` have their KV in the cache. The scheduler extends that range
    every step; when it reaches `num_tokens`, the worker samples one more token.
    """

    __slots__ = (
        "block_table",
        "finish_reason",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_prompt_tokens",
        "params",
        "rid",
        "seq_id",
        "status",
        "token_ids",
    )

    def __init__(
        self, seq_id: int, rid: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("a prompt needs at least one token")
        if params.max_tokens is None:
            raise ValueError("the scheduler needs max_tokens resolved by the frontend")
        self.seq_id = seq_id
        self.rid = rid
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prompt tokens from the prefix cache; -1 until admitted
        self.block_table: list[int] = []
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id}, {self.rid!r}, {self.status.value}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"blocks={self.block_table})"
        )
