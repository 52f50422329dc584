"""Incremental detokenization: the text of each new token, in O(1) per token.

Built on `tokenizers`' DecodeStream, which holds back the bytes of a character split across
tokens until it is complete, so no U+FFFD leaks from a half-decoded character. The stream is
primed with the end of the prompt so the first output token is spaced as it is mid-text.

With special tokens kept in the text, the stream's text is what fast tokenizers decode; turning
`spaces_between_special_tokens` off returns consecutive added tokens without the space some
decoders put before them, as vLLM's fast detokenizer does (slow Hugging Face tokenizers add
spaces around them instead; we require fast ones).
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase

_PROMPT_CONTEXT = 4  # prompt tokens replayed to prime spacing and merges


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError("streaming text needs a fast tokenizer (tokenizer.json)")
        self._backend = backend
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        for token_id in prompt_token_ids[-_PROMPT_CONTEXT:]:
            self._stream.step(backend, token_id)  # its text belongs to the prompt: dropped
        self._added: dict[int, str] = {}  # id -> text of the added tokens, when unspaced
        if not skip_special_tokens and not spaces_between_special_tokens:
            self._added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
        self._last_added = False  # the last token was an added one

    def push(self, token_id: int) -> str:
        """Text that token completes (empty while a character is still partial)."""
        text = self._stream.step(self._backend, token_id) or ""
        if self._added:
            added = self._added.get(token_id)
            if added is not None and self._last_added:
                text = added  # no space between two added tokens
            self._last_added = added is not None
        return text
