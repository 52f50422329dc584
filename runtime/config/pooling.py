"""Per-request embedding parameters: how a prompt's hidden states become one vector."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from runtime.config.errors import FieldError

# "last": the last token's hidden state (decoder models: the only one that saw the whole
# input); "mean": the average over the input's own tokens; "cls": the first token's.
POOLING_TYPES = ("last", "mean", "cls")


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """What an embedding request asks for. Invalid values raise ValueError at construction.

    The vector is pooled from the final norm's output (a decoder's `last_hidden_state`), then
    cut to `dimensions`, then normalized, as vLLM's pooler does.

    Attributes:
        pooling_type: "last", "mean" or "cls" (see POOLING_TYPES); "" takes the engine's
            default (`EngineConfig.pooling`, `--pooling`).
        normalize: scale the vector to unit length (vLLM's `normalize`, default true).
        dimensions: keep only the first this many values (OpenAI's `dimensions`): only for
            models whose config declares matryoshka representations.
        truncate_prompt_tokens: keep only the last this many tokens of a longer input; -1:
            as many as the context holds; None: an input longer than the context is refused
            (vLLM's meaning).
    """

    pooling_type: str = ""
    normalize: bool = True
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.pooling_type not in ("", *POOLING_TYPES):
            choices = ", ".join(POOLING_TYPES)
            raise FieldError("pooling_type", f"must be one of {choices}: {self.pooling_type!r}")
        if self.dimensions is not None and self.dimensions < 1:
            raise FieldError("dimensions", f"must be at least 1, got {self.dimensions}")
        truncate = self.truncate_prompt_tokens
        if truncate is not None and truncate < 1 and truncate != -1:
            raise FieldError("truncate_prompt_tokens", f"must be -1 or at least 1, got {truncate}")

    @property
    def reads_every_token(self) -> bool:
        """Whether the vector needs the hidden state of tokens before the last: then the
        prefix cache, which holds keys and values but no hidden states, cannot serve any."""
        return self.pooling_type != "last"

    def replace(self, **changes: object) -> PoolingParams:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]
