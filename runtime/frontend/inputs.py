"""Request validation in the frontend: prompts to token ids, limits, chat templates.

Everything here raises ValueError with a message meant for the client (`api/` turns it into a
400) before anything is queued, so a bad request never reaches an actor.

Tokenizing is per-request CPU work that must not stall the event loop every request shares:
a text that cannot fit the context is refused before it is tokenized (`check_fits`, a bound
from its byte length), and the async methods run long texts in a worker thread, through
`tokenizers`' batch call, which releases the GIL (measured: a 900 kB text holds the GIL for
0.66 s through `encode`, and lets other threads run every 2 ms through `encode_batch_fast`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import trio
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerBase

from runtime.sampling_params import SamplingParams

T = TypeVar("T")

# Shorter texts are tokenized on the event loop: a thread hop would cost more than the work.
INLINE_CHARS = 4096
# A normalizer may drop characters, so the bound only refuses texts twice over the limit.
_MARGIN = 2


def _plain_copy(backend: Tokenizer | None) -> Tokenizer | None:
    """Our own copy of the fast tokenizer, with truncation and padding off: a tokenizer.json
    may switch them on, and transformers turns them off only around its own calls."""
    if backend is None:
        return None
    copy = Tokenizer.from_str(backend.to_str())
    copy.no_truncation()
    copy.no_padding()
    return copy


class InputProcessor:
    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, *, vocab_size: int, max_model_len: int
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self._backend = _plain_copy(getattr(tokenizer, "backend_tokenizer", None))
        # the most bytes of text one token can stand for (a UTF-8 token string is no shorter)
        self.max_token_bytes = max(len(token.encode()) for token in tokenizer.get_vocab()) or 1
        self._threads = trio.CapacityLimiter(2)

    def check_fits(self, *texts: str) -> None:
        """Refuse, before tokenizing them, texts too long for the context whatever the tokens."""
        size = sum(len(t.encode()) for t in texts)  # a lone surrogate is a ValueError too
        at_least = size // (self.max_token_bytes * _MARGIN)
        if at_least > self.max_model_len:
            raise ValueError(
                f"the text is {size} bytes, so over {at_least} tokens, and this model's "
                f"context is {self.max_model_len} tokens"
            )

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.check_fits(text)
        if self._backend is not None:
            (encoding,) = self._backend.encode_batch_fast(
                [text], add_special_tokens=add_special_tokens
            )
            return list(encoding.ids)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    async def tokenize_async(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) < INLINE_CHARS:
            return self.tokenize(text, add_special_tokens)
        self.check_fits(text)  # refused here: no thread needed
        return await self._in_thread(self.tokenize, text, add_special_tokens)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        self.check_token_ids(token_ids)
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=False))

    async def detokenize_async(self, token_ids: Sequence[int]) -> str:
        if len(token_ids) < INLINE_CHARS // 4:
            return self.detokenize(token_ids)
        return await self._in_thread(self.detokenize, token_ids)

    async def apply_chat_template_async(self, messages: list[dict[str, str]]) -> str:
        texts = [value for m in messages for value in m.values()]  # contents, names, roles
        if sum(len(t) for t in texts) < INLINE_CHARS:
            return self.apply_chat_template(messages)
        self.check_fits(*texts)  # the render holds them all
        return await self._in_thread(self.apply_chat_template, messages)

    async def _in_thread(self, fn: Callable[..., T], *args: object) -> T:
        return await trio.to_thread.run_sync(fn, *args, limiter=self._threads)

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
