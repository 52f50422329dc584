"""Request validation in the frontend: prompts to token ids, limits, chat templates.

Everything here raises ValueError with a message meant for the client (`api/` turns it into a
400) before anything is queued, so a bad request never reaches an actor.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from runtime.sampling_params import SamplingParams


class InputProcessor:
    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, *, vocab_size: int, max_model_len: int
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        text.encode()  # a lone surrogate (JSON allows "\ud800") is a UnicodeError, a ValueError
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def detokenize(self, token_ids: Sequence[int]) -> str:
        self.check_token_ids(token_ids)
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=False))

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template; use /v1/completions")
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:  # jinja errors from a template that rejects the messages
            raise ValueError(f"the chat template rejected the messages: {exc}") from None
        return str(text)

    def prompt_token_ids(self, prompt: str | Sequence[int]) -> tuple[int, ...]:
        if isinstance(prompt, str):
            token_ids = tuple(self.tokenize(prompt))
        else:
            token_ids = tuple(prompt)
            self.check_token_ids(token_ids)
        if not token_ids:
            raise ValueError("the prompt is empty")
        return token_ids

    def check_token_ids(self, token_ids: Sequence[int]) -> None:
        vocab = self.vocab_size
        bad = [t for t in token_ids if not (type(t) is int and 0 <= t < vocab)]
        if bad:
            raise ValueError(f"token ids must be ints in [0, {vocab}), got {bad[:5]}")

    def max_tokens(self, params: SamplingParams, num_prompt_tokens: int) -> int:
        """How many tokens the request may generate: its own limit, or what the context leaves.

        Also checks what of `params` depends on the model (SamplingParams checked the rest).
        """
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise ValueError(
                f"the prompt has {num_prompt_tokens} tokens, but this model's context is "
                f"{self.max_model_len} tokens and at least one must be left to generate"
            )
        if params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens, but "
                f"{num_prompt_tokens + params.max_tokens} were requested ({num_prompt_tokens} in "
                f"the prompt, {params.max_tokens} to generate)"
            )
        if any(t >= self.vocab_size for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be below the vocabulary size {self.vocab_size}")
        return params.max_tokens or room
