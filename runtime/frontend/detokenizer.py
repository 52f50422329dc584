"""Incremental detokenization: the text of each new token, in O(1) per token.

Built on `tokenizers`' DecodeStream, which holds back the bytes of a character split across
tokens until it is complete, so no U+FFFD leaks from a half-decoded character. The stream is
primed with the end of the prompt so the first output token is spaced as it is mid-text.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase

_PROMPT_CONTEXT = 4  # prompt tokens replayed to prime spacing and merges


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: Sequence[int]) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError("streaming text needs a fast tokenizer (tokenizer.json)")
        self._backend = backend
        self._stream = DecodeStream(skip_special_tokens=True)
        for token_id in prompt_token_ids[-_PROMPT_CONTEXT:]:
            self._stream.step(backend, token_id)  # its text belongs to the prompt: dropped

    def push(self, token_id: int) -> str:
        """Text that token completes (empty while a character is still partial)."""
        return self._stream.step(self._backend, token_id) or ""
