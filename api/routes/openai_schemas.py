"""Request bodies of the OpenAI routes (completions, chat completions, tokenize), under the
field policy of api/http/fields.py: OpenAI's fields and vLLM's and SGLang's extensions are
implemented, accepted as no-ops, or refused at any value but their default."""

from __future__ import annotations

from functools import partial
from typing import Annotated, Any, Literal

from pydantic import Field, PrivateAttr, model_validator

from api.http.errors import unsupported
from api.http.fields import Body, Refusal, refusals
from api.routes.sampling_fields import (
    MAX_PROMPTS,
    SAMPLING_REFUSALS,
    Count,
    NonEmptyStr,
    SamplingFields,
    TokenIds,
)
from api.routes.structured_fields import ResponseFormat, Spelling
from api.routes.tool_fields import (
    CallId,
    ToolCalls,
    ToolChoice,
    Tools,
    check_call_ids,
    check_tools,
)
from runtime.protocol import Constraint, SamplingParams

# Labels, billing and caching hints a server may take and do nothing with.
OPENAI_NO_OPS = frozenset(
    {"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
     "request_id", "cache_salt", "stream_interval"}
)  # fmt: skip


class StreamOptions(Body):
    refused_unless = refusals(
        continuous_usage_stats=Refusal((False,), "is not supported yet"),  # vLLM's
    )
    include_usage: bool = False


class Sampling(SamplingFields):
    """The fields shared by completions and chat completions."""

    no_ops = OPENAI_NO_OPS
    refused_unless = refusals(
        SAMPLING_REFUSALS,
        truncate_prompt_tokens=Refusal((), "is not supported: send a prompt that fits"),
        return_tokens_as_token_ids=Refusal((False,), "is not supported"),
        return_token_ids=Refusal((False,), "is not supported yet"),
        prompt_embeds=Refusal((), "prompt embeddings are not supported"),
        kv_transfer_params=Refusal((), "KV transfer is not supported"),
        session_params=Refusal((), "sessions are served on /generate"),
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    min_tokens: Count = 0  # vLLM's and SGLang's
    response_format: ResponseFormat | None = None  # completions: vLLM's

    def spellings(self) -> list[Spelling]:
        found = super().spellings()
        fmt = self.response_format
        if fmt is not None and fmt.type != "text":
            found.append(("response_format", fmt.constraint))
        return found

    @model_validator(mode="after")
    def _check_stream_options(self) -> Sampling:
        if self.stream_options is not None and not self.stream:
            raise unsupported("stream_options", "is only allowed with stream=true")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(Sampling):
    refused_unless = refusals(
        Sampling.refused_unless,
        best_of=Refusal((1,), "is not supported (vLLM V1 rejects it too): use n"),
        suffix=Refusal(("",), "is not supported"),
    )
    model: str
    prompt: (
        NonEmptyStr
        | TokenIds
        | Annotated[list[NonEmptyStr | TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    )
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: Count | None = None
    echo: bool = False
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS on a text prompt

    def params(self) -> SamplingParams:
        # echo with logprobs scores the prompt too (vLLM's): from its first token
        prompt_logprobs = self.logprobs if self.echo else None
        return self.sampling_params(
            self.max_tokens,
            min_tokens=self.min_tokens,
            logprobs=self.logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    def prompts(self) -> list[str | list[int]]:
        """One entry per choice: a text, or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class TextPart(Body):
    type: Literal["text"]
    text: str


class ChatMessage(Body):
    no_ops = frozenset({"refusal", "annotations"})  # parts of OpenAI's own answers
    refused_unless = refusals(
        function_call=Refusal((), "the legacy function_call is not supported: use tool_calls"),
        audio=Refusal((), "audio is not supported"),
    )
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: ToolCalls | None = None  # an assistant's
    tool_call_id: CallId | None = None  # a tool result's: the call it answers

    @model_validator(mode="after")
    def _check_tool_fields(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise unsupported("tool_calls", "only an assistant message makes tool calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise unsupported("tool_call_id", "a tool message needs the id of the call it answers")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def as_dict(self) -> dict[str, Any]:
        """The message as the chat template sees it (templates may use `name`, as in vLLM)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.as_dict() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


# A conversation's messages: each costs about 10 us to validate, on the event loop.
MAX_MESSAGES = 2048
Messages = Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]

LEGACY_FUNCTIONS = "the legacy functions API is not supported: use tools and tool_choice"


class ChatCompletionRequest(Sampling):
    no_ops = Sampling.no_ops | {"separate_reasoning", "stream_reasoning"}
    refused_unless = refusals(
        Sampling.refused_unless,
        functions=Refusal(([],), LEGACY_FUNCTIONS),
        function_call=Refusal(("none",), LEGACY_FUNCTIONS),
        modalities=Refusal((["text"],), "only text output is supported"),
        audio=Refusal((), "audio output is not supported"),
        prediction=Refusal((), "predicted outputs are not supported"),
        web_search_options=Refusal((), "web search is not supported"),
        echo=Refusal((False,), "is not supported on chat completions"),
        add_generation_prompt=Refusal((True,), "is not supported at another value yet"),
        continue_final_message=Refusal((False,), "is not supported yet"),
        chat_template=Refusal((), "a request's own chat template is not accepted"),
        documents=Refusal(([],), "documents are not supported"),
        mm_processor_kwargs=Refusal(({},), "there is no multimodal processor"),
    )
    model: str
    messages: Messages
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Count | None = None
    # vLLM's and SGLang's: extra variables for the chat template (e.g. enable_thinking)
    chat_template_kwargs: Annotated[dict[str, Any], Field(max_length=32)] | None = None
    tools: Tools | None = None
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, else "none"
    parallel_tool_calls: bool = True
    _tool_grammar: str | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise unsupported("top_logprobs", "needs logprobs=true")
        return self

    @model_validator(mode="after")
    def _check_tools(self) -> ChatCompletionRequest:
        check_tools(self.tools or [], self.tool_choice)
        check_call_ids(self.messages)
        return self

    def params(self, tool_grammar: str | None = None) -> SamplingParams:
        """`tool_grammar`: what tool_choice constrains the output to (api/tools/choice.py);
        with another constraint on the request it is a 400 naming both."""
        self._tool_grammar = tool_grammar
        return self.sampling_params(
            self.max_output_tokens,
            min_tokens=self.min_tokens,
            logprobs=(self.top_logprobs or 0) if self.logprobs else None,
        )

    def spellings(self) -> list[Spelling]:
        found = super().spellings()
        if self._tool_grammar is not None:
            found.append(("tool_choice", partial(Constraint, "grammar", self._tool_grammar)))
        return found

    def conversation(self) -> list[dict[str, Any]]:
        return [m.as_dict() for m in self.messages]

    def tool_dicts(self) -> list[dict[str, Any]]:
        return [tool.as_dict() for tool in self.tools or []]

    @property
    def chosen_tools(self) -> str | dict[str, Any]:
        """tool_choice, with OpenAI's default filled in."""
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        if isinstance(self.tool_choice, str):
            return self.tool_choice
        return self.tool_choice.model_dump()

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class TokenizeRequest(Body):
    model: str | None = None
    prompt: str | None = None
    messages: Messages | None = None
    tools: Tools | None = None  # vLLM's: rendered with the messages
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise unsupported("prompt", "give exactly one of prompt or messages")
        return self


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]
