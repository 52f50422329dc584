"""What the trio client returns: OpenAI's answers, parsed into dataclasses."""

from __future__ import annotations

import base64
import struct
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def parse(cls, data: dict[str, Any] | None) -> Usage | None:
        if not data:
            return None
        return cls(data["prompt_tokens"], data["completion_tokens"], data["total_tokens"])


@dataclass(frozen=True, slots=True)
class CompletionLogprobs:
    """OpenAI's completion log-probabilities: per token its text, log-probability (None for
    an echoed prompt's first token), most likely tokens by text, and offset in the text."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]

    @classmethod
    def parse(cls, data: dict[str, Any] | None) -> CompletionLogprobs | None:
        if data is None:
            return None
        return cls(
            data["tokens"], data["token_logprobs"], data["top_logprobs"], data["text_offset"]
        )


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One token of OpenAI's chat log-probabilities (`top_logprobs` empty for alternatives)."""

    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TokenLogprob]

    @classmethod
    def parse(cls, data: dict[str, Any]) -> TokenLogprob:
        top = [cls.parse(t) for t in data.get("top_logprobs") or []]
        return cls(data["token"], data["logprob"], data.get("bytes"), top)


def parse_chat_logprobs(data: dict[str, Any] | None) -> list[TokenLogprob] | None:
    if data is None:
        return None
    return [TokenLogprob.parse(t) for t in data.get("content") or []]


@dataclass(frozen=True, slots=True)
class CompletionChoice:
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


@dataclass(frozen=True, slots=True)
class Completion:
    """A `/v1/completions` answer, or one streamed chunk of it."""

    id: str
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None

    @classmethod
    def parse(cls, data: dict[str, Any]) -> Completion:
        choices = [
            CompletionChoice(
                c["index"],
                c["text"],
                c.get("finish_reason"),
                CompletionLogprobs.parse(c.get("logprobs")),
            )
            for c in data["choices"]
        ]
        return cls(data["id"], data["model"], choices, Usage.parse(data.get("usage")))


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call the model made; in a streamed chunk, a piece of one (the call at `index`: its
    id and name once, then fragments of its arguments)."""

    id: str | None
    name: str | None
    arguments: str  # JSON text
    index: int | None = None

    @classmethod
    def parse(cls, data: dict[str, Any]) -> ToolCall:
        function = data.get("function") or {}
        return cls(data.get("id"), function.get("name"), function.get("arguments") or "",
                   data.get("index"))  # fmt: skip

    def as_dict(self) -> dict[str, Any]:
        """The call as an assistant message of the history holds it."""
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str | None
    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """The message as the next request's history holds it."""
        message: dict[str, Any] = {"role": self.role or "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [call.as_dict() for call in self.tool_calls]
        return message


@dataclass(frozen=True, slots=True)
class ChatChoice:
    index: int
    message: ChatMessage  # for a streamed chunk: the delta
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None  # the `content` of OpenAI's


@dataclass(frozen=True, slots=True)
class ChatCompletion:
    """A `/v1/chat/completions` answer, or one streamed chunk (whose messages are deltas)."""

    id: str
    model: str
    choices: list[ChatChoice]
    usage: Usage | None

    @classmethod
    def parse(cls, data: dict[str, Any]) -> ChatCompletion:
        choices = []
        for c in data["choices"]:
            message = c.get("message") or c.get("delta") or {}
            choices.append(
                ChatChoice(
                    c["index"],
                    ChatMessage(
                        message.get("role"),
                        message.get("content"),
                        tuple(ToolCall.parse(call) for call in message.get("tool_calls") or ()),
                    ),
                    c.get("finish_reason"),
                    parse_chat_logprobs(c.get("logprobs")),
                )
            )
        return cls(data["id"], data["model"], choices, Usage.parse(data.get("usage")))


@dataclass(frozen=True, slots=True)
class Model:
    id: str
    max_model_len: int | None


@dataclass(frozen=True, slots=True)
class EmbeddingData:
    index: int
    embedding: list[float]

    @classmethod
    def parse(cls, data: dict[str, Any]) -> EmbeddingData:
        """Values as JSON numbers, or little-endian float32 in base64 (OpenAI's two forms)."""
        values = data["embedding"]
        if isinstance(values, str):
            raw = base64.b64decode(values)
            values = list(struct.unpack(f"<{len(raw) // 4}f", raw))
        return cls(data["index"], values)


@dataclass(frozen=True, slots=True)
class Embeddings:
    """A `/v1/embeddings` answer: one entry per input, in input order."""

    data: list[EmbeddingData]
    model: str
    prompt_tokens: int

    @classmethod
    def parse(cls, data: dict[str, Any]) -> Embeddings:
        entries = [EmbeddingData.parse(d) for d in data["data"]]
        return cls(entries, data["model"], data["usage"]["prompt_tokens"])
