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

import contextlib
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import trio
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerBase

from runtime.config.engine import EngineConfig
from runtime.config.sampling import SamplingParams
from runtime.frontend.chat_templates import template_for

T = TypeVar("T")
# apply_chat_template's own arguments: a request's template variables may not set them
TEMPLATE_ARGUMENTS = frozenset(
    {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
     "continue_final_message", "tokenize", "padding", "truncation", "max_length",
     "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}
)  # fmt: skip


def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the byte each character of a token stands for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars = {b: chr(b) for b in printable}
    shifted = [b for b in range(256) if b not in chars]
    chars |= {b: chr(256 + i) for i, b in enumerate(shifted)}
    return {c: b for b, c in chars.items()}


_BYTE_OF = _byte_of_char()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte tokens

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
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        config: EngineConfig,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.max_model_len = config.max_model_len
        self.max_n = config.max_n
        self.max_logprobs = config.max_logprobs
        self._token_texts: dict[int, str] = {}
        self._bytes: dict[int, bytes] = {}
        self._backend = _plain_copy(getattr(tokenizer, "backend_tokenizer", None))
        decoder = getattr(self._backend, "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"  # tokens spell their bytes
        # the most bytes of text one token can stand for (a UTF-8 token string is no shorter)
        self.max_token_bytes = max(len(token.encode()) for token in tokenizer.get_vocab()) or 1
        self._threads = trio.CapacityLimiter(2)
        self.chat_template = config.chat_template
        # a chat message's text must not smuggle in control tokens (an <|im_end|> that ends
        # the user's turn early, an EOS): a client writes text, the template writes structure
        specials = {str(t) for t in tokenizer.all_special_tokens} | {
            str(t.content) for t in getattr(tokenizer, "added_tokens_decoder", {}).values()
            if getattr(t, "special", False)
        }  # fmt: skip
        self._specials = (
            None
            if config.allow_special_tokens_in_messages or not specials
            else re.compile("|".join(map(re.escape, sorted(specials, key=len, reverse=True))))
        )

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

    async def apply_chat_template_async(
        self,
        messages: list[dict[str, Any]],
        template_kwargs: Mapping[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        self.check_messages(messages)
        texts = [text for _, text in _strings(messages)]  # contents, names, roles, calls
        texts += [text for _, text in _strings(tools or [])]
        if sum(len(t) for t in texts) < INLINE_CHARS:
            return self._render(messages, template_kwargs, tools)
        self.check_fits(*texts)  # the render holds them all
        return await self._in_thread(self._render, messages, template_kwargs, tools)

    async def _in_thread(self, fn: Callable[..., T], *args: object) -> T:
        return await trio.to_thread.run_sync(fn, *args, limiter=self._threads)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        template_kwargs: Mapping[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The conversation rendered, ready for the reply; `template_kwargs` are variables the
        template may read (e.g. Qwen3's `enable_thinking`), never its own arguments; `tools`
        the functions the model may call (OpenAI's `tools`), listed where the template
        lists them (runtime/frontend/chat_templates.py)."""
        self.check_messages(messages)
        return self._render(messages, template_kwargs, tools)

    def _render(
        self,
        messages: list[dict[str, Any]],
        template_kwargs: Mapping[str, Any] | None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        template = template_for(self._own_template(bool(tools)), bool(tools))
        if not template:
            raise ValueError("this model has no chat template; use /v1/completions")
        kwargs = dict(template_kwargs or {})
        reserved = sorted(kwargs.keys() & TEMPLATE_ARGUMENTS)
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}")
        listed: list[Any] | None = list(tools) if tools else None  # transformers' own type
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=listed, chat_template=template, tokenize=False,
                add_generation_prompt=True, **kwargs,
            )  # fmt: skip
        except Exception as exc:  # jinja errors from a template that rejects the messages
            raise ValueError(f"the chat template rejected the messages: {exc}") from None
        return str(text)

    def _own_template(self, with_tools: bool) -> str | None:
        """--chat-template's, or the tokenizer's (of several named ones, "tool_use" for a
        request with tools where there is one, else "default")."""
        own = self.chat_template or getattr(self.tokenizer, "chat_template", None)
        if isinstance(own, dict):
            return own.get("tool_use") if with_tools and "tool_use" in own else own.get("default")
        return own

    def check_messages(self, messages: list[dict[str, Any]]) -> None:
        """Each message's text (its calls' too): valid Unicode, and no special token (unless
        allowed)."""
        for i, message in enumerate(messages):
            for key, value in _strings(message):
                try:
                    value.encode()
                except UnicodeEncodeError:
                    raise ValueError(
                        f"messages[{i}].{key}: is not valid Unicode text (a lone surrogate?)"
                    ) from None
                found = self._specials.search(value) if self._specials is not None else None
                if found is not None:
                    raise ValueError(
                        f"messages[{i}].{key} holds the special token {found.group()!r}, which "
                        "would act as a control token (--allow-special-tokens-in-messages "
                        "lets it through)"
                    )

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
        return params.max_tokens or room

    def check_limits(self, params: SamplingParams, in_session: bool) -> None:
        if params.n > self.max_n:
            raise ValueError(f"n must be at most {self.max_n} (--max-n), got {params.n}")
        if params.n > 1 and in_session:
            raise ValueError("a session turn takes n=1")
        if params.prompt_logprobs is not None and in_session:
            raise ValueError(
                "prompt log-probabilities (echo, logprob_start_len) are not available in a "
                "session turn, whose prompt continues the session's history"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise ValueError(
                    f"{name} must be at most {self.max_logprobs} (--max-logprobs), got {value}"
                )

    def token_bytes(self, token_ids: Sequence[int]) -> list[bytes]:
        """Each token's own bytes: a byte-level token's raw bytes (part of a character, too),
        a byte-fallback token's byte, else its text in UTF-8."""
        self.check_token_ids(token_ids)
        return [self._token_bytes(t) for t in token_ids]

    def _token_bytes(self, token_id: int) -> bytes:
        cached = self._bytes.get(token_id)
        if cached is not None:
            return cached
        token = str(self.tokenizer.convert_ids_to_tokens(token_id))
        raw = None
        if self._byte_level:
            with contextlib.suppress(KeyError):  # an added token may hold other characters
                raw = bytes([_BYTE_OF[c] for c in token])
        if raw is None:
            fallback = _BYTE_FALLBACK.fullmatch(token)
            raw = (
                bytes([int(fallback.group(1), 16)])
                if fallback
                else str(self.tokenizer.decode([token_id], skip_special_tokens=False)).encode()
            )
        self._bytes[token_id] = raw
        return raw

    def token_texts(self, token_ids: Sequence[int]) -> list[str]:
        """Each token decoded alone; "" where that is only part of a character (vLLM's)."""
        texts = self._token_texts
        out = []
        for token_id in token_ids:
            text = texts.get(token_id)
            if text is None:
                self.check_token_ids([token_id])
                text = str(self.tokenizer.decode([token_id], skip_special_tokens=False))
                text = texts[token_id] = "" if text.endswith("\ufffd") else text
            out.append(text)
        return out

    def resolve(self, params: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        """`params` checked against the model and the prompt, with `bad_words` tokenized."""
        params.check_vocabulary(self.vocab_size)
        if params.prompt_logprobs is not None and params.prompt_logprobs_start >= num_prompt_tokens:
            raise ValueError(
                f"the prompt log-probabilities start at position {params.prompt_logprobs_start}, "
                f"but the prompt has {num_prompt_tokens} tokens"
            )
        if params.bad_words:
            words = list(params.bad_words_token_ids)
            for word in params.bad_words:
                for variant in self._bad_word_variants(word):
                    if variant and variant not in words:
                        words.append(variant)
            params = params.replace(bad_words_token_ids=tuple(words))
        self._check_something_allowed(params)
        return params

    def _check_something_allowed(self, params: SamplingParams) -> None:
        """Refuse masks that leave no token to sample (the sampler would pick any)."""
        if params.allowed_token_ids is None:
            return
        allowed = set(params.allowed_token_ids)
        allowed -= {word[0] for word in params.bad_words_token_ids if len(word) == 1}
        if not allowed:
            raise ValueError("every token of allowed_token_ids is also a bad word")
        if params.min_tokens and allowed <= self.eos_token_ids | set(params.stop_token_ids):
            raise ValueError(
                "allowed_token_ids holds only stop tokens, which min_tokens forbids at first"
            )

    def _bad_word_variants(self, word: str) -> list[tuple[int, ...]]:
        """The word's tokens as it would start a text and, as vLLM does, as it would follow a
        space (a different token in most vocabularies)."""
        self.check_fits(word)
        plain = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if len(spaced) == len(plain) and spaced[:1] != plain[:1]:
            return [plain, spaced]
        return [plain]


def _strings(value: Any, where: str = "") -> list[tuple[str, str]]:
    """Every string in a message (or a list of them), with where it is ("content",
    "tool_calls[0].function.name")."""
    if isinstance(value, str):
        return [(where, value)]
    if isinstance(value, dict):
        return [found for key, item in value.items()
                for found in _strings(item, f"{where}.{key}" if where else str(key))]  # fmt: skip
    if isinstance(value, list):
        return [found for i, item in enumerate(value) for found in _strings(item, f"{where}[{i}]")]
    return []
