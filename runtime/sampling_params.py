"""Per-request sampling and stopping parameters."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

_NO_VOCABULARY_IS_THIS_LARGE = 2**31


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop. Invalid values raise ValueError at construction.

    Attributes:
        max_tokens: most tokens to generate; None means up to the context limit.
        temperature: 0 means greedy (argmax); otherwise logits are divided by it.
        top_k: keep the k most likely tokens; 0 (or -1, or more than the vocabulary) keeps all.
        top_p: keep the smallest set of tokens whose probability reaches p.
        min_p: drop tokens less likely than min_p times the most likely one.
        seed: makes sampling reproducible, whatever else shares the batch.
        ignore_eos: keep generating after an end-of-sequence token.
        stop_token_ids: extra token ids that end the sequence (the id is returned).
        stop: strings that end the sequence; the match is not part of the text.
    """

    max_tokens: int | None = None
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and 0.0 <= self.temperature <= 100.0):
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if self.top_k == -1 or self.top_k >= _NO_VOCABULARY_IS_THIS_LARGE:
            object.__setattr__(self, "top_k", 0)  # all of them, and it fits the wire's int64
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def replace(self, **changes: object) -> SamplingParams:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]
