"""Per-request sampling and stopping parameters."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from runtime.config.constraint import Constraint

_NO_VOCABULARY_IS_THIS_LARGE = 2**31
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a bias, either way


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
        n: samples to draw from the prompt; the prompt is computed once and shared. With a
            seed, sample i uses seed + i.
        presence_penalty: subtracted from the logit of each token generated so far (-2 to 2).
        frequency_penalty: subtracted once per time a token was generated so far (-2 to 2).
        repetition_penalty: divides positive (multiplies negative) logits of every token in
            the prompt or the output so far (Hugging Face's definition); 1 is off.
        logit_bias: (token id, bias) pairs added to the logits before anything else
            changes them (-100 to 100 each).
        min_tokens: EOS and stop tokens cannot be sampled, and stop strings do not match,
            before this many tokens are generated.
        bad_words: texts never to generate; the engine resolves them to `bad_words_token_ids`.
        bad_words_token_ids: token sequences never to generate: the last token of each is
            banned whenever the output ends with the ones before it.
        allowed_token_ids: if set, only these tokens can be sampled.
        logprobs: also return this many most likely tokens, with their log-probabilities,
            at each generated position (None: only the sampled token's).
        prompt_logprobs: return the log-probability of each prompt token from position
            `prompt_logprobs_start` on, with this many most likely tokens (None: none).
        prompt_logprobs_start: the first prompt position `prompt_logprobs` covers.
        skip_special_tokens: leave special tokens out of the text.
        spaces_between_special_tokens: with special tokens in the text, put a space between
            each of them and its neighbours (as slow Hugging Face tokenizers decode).
        include_stop_str_in_output: keep the matched stop string at the end of the text.
        constraint: structured output: what the output must match (a JSON schema, a regex,
            choices, a grammar); tokens that cannot continue a match are never sampled, and
            once it is complete only EOS is.
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
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    bad_words: tuple[str, ...] = ()
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_logprobs_start: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    constraint: Constraint | None = None

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
        self._check_extensions()
        if self.top_k == -1 or self.top_k >= _NO_VOCABULARY_IS_THIS_LARGE:
            object.__setattr__(self, "top_k", 0)  # all of them, and it fits the wire's int64
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "bad_words", tuple(self.bad_words))
        object.__setattr__(self, "logit_bias", tuple((t, float(b)) for t, b in self.logit_bias))
        object.__setattr__(
            self, "bad_words_token_ids", tuple(tuple(w) for w in self.bad_words_token_ids)
        )
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))

    def _check_extensions(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2.0 <= value <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for token_id, bias in self.logit_bias:
            if token_id < 0:
                raise ValueError(f"logit_bias token ids must be non-negative, got {token_id}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:  # NaN fails too
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if any(not w for w in self.bad_words) or any(not w for w in self.bad_words_token_ids):
            raise ValueError("bad words must not be empty")
        if any(t < 0 for w in self.bad_words_token_ids for t in w):
            raise ValueError("bad_words_token_ids must be non-negative")
        if self.allowed_token_ids is not None and (
            not self.allowed_token_ids or any(t < 0 for t in self.allowed_token_ids)
        ):
            raise ValueError("allowed_token_ids must be a non-empty list of token ids")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.prompt_logprobs_start < 0:
            raise ValueError(
                f"prompt_logprobs_start must be >= 0, got {self.prompt_logprobs_start}"
            )

    def check_vocabulary(self, vocab_size: int) -> None:
        """ValueError unless every token id here is below `vocab_size` (the worker indexes
        the logits with them) and at most `vocab_size` log-probabilities are asked for."""
        for name, ids in (
            ("stop_token_ids", self.stop_token_ids),
            ("logit_bias", [t for t, _ in self.logit_bias]),
            ("allowed_token_ids", self.allowed_token_ids or ()),
            ("bad_words_token_ids", [t for word in self.bad_words_token_ids for t in word]),
        ):
            if any(t >= vocab_size for t in ids):
                raise ValueError(
                    f"{name}: token ids must be below the vocabulary size {vocab_size}"
                )
        if max(self.logprobs or 0, self.prompt_logprobs or 0) > vocab_size:
            raise ValueError(f"at most {vocab_size} log-probabilities per position")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalizes(self) -> bool:
        """Whether a penalty depends on the tokens so far (the worker keeps counts)."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def processes_logits(self) -> bool:
        """Whether the logits change before sampling (penalties, bias, masks)."""
        return bool(
            self.penalizes
            or self.logit_bias
            or self.min_tokens
            or self.bad_words_token_ids
            or self.allowed_token_ids is not None
        )

    def replace(self, **changes: object) -> SamplingParams:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]
