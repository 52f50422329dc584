"""Request bodies, validated strictly: wrong types, out-of-range values and unknown fields are
400s that name the field. Fields we know but do not implement are accepted only at their
no-op value (e.g. `tools: []`, `best_of: 1`), so nothing a client asks for is silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from api.http.errors import APIError, unsupported
from runtime.protocol import SamplingParams, SessionParams

# Caps on the lists a client controls, so that no request costs the others more than its share
# (each stop string is searched for in every new piece of text, each stop token id per token).
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_LENGTH = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_PROMPTS = 128  # prompts in one /v1/completions request, each a sequence
MAX_LOGIT_BIAS = 300  # entries, as OpenAI caps them
MAX_BAD_WORDS = 64
MAX_ALLOWED_TOKEN_IDS = 2**18

NonEmptyStr = Annotated[str, Field(min_length=1)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_LENGTH)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
Seed = Annotated[int, Field(ge=-(2**63), lt=2**64)]  # what the sampler's 64-bit hash takes
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]
Count = Annotated[int, Field(ge=0, lt=2**31)]  # n, logprobs...: the engine applies its limits
TokenId = Annotated[int, Field(ge=0, lt=2**31)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's; accepted only as false (not implemented)

    @model_validator(mode="after")
    def _reject_unimplemented(self) -> StreamOptions:
        if self.continuous_usage_stats:
            raise unsupported("stream_options.continuous_usage_stats", "is not supported yet")
        return self


class SamplingFields(Strict):
    """How to sample, as OpenAI's, vLLM's and SGLang's APIs all spell it; null means default."""

    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: (
        Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOP_TOKEN_IDS)] | None
    ) = None
    seed: Seed | None = None
    ignore_eos: bool = False
    n: Annotated[int, Field(ge=1, lt=2**31)] = 1
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=1e6)] | None = None
    logit_bias: Annotated[dict[str, Bias], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    bad_words: Annotated[list[StopString], Field(max_length=MAX_BAD_WORDS)] | None = None
    allowed_token_ids: (
        Annotated[list[TokenId], Field(min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)] | None
    ) = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def sampling_params(self, max_tokens: int | None, **more: Any) -> SamplingParams:
        """The request's SamplingParams: built here, once, and passed through the engine
        (`more`: fields the route spells its own way, e.g. min_tokens, logprobs).

        Its own checks (combinations the schema cannot see) are 400s too.
        """
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        fields = dict(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            stop=tuple(stop),
            n=self.n,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            logit_bias=self._logit_bias(),
            bad_words=tuple(self.bad_words or ()),
            allowed_token_ids=(
                tuple(self.allowed_token_ids) if self.allowed_token_ids is not None else None
            ),
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )
        try:
            return SamplingParams(**(fields | more))
        except ValueError as exc:
            raise APIError(400, str(exc), code="invalid_value") from None

    def _logit_bias(self) -> tuple[tuple[int, float], ...]:
        """OpenAI's keys are token ids written as strings."""
        bias = []
        for key, value in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit() and len(key) < 10):
                raise APIError(
                    400,
                    f"logit_bias keys must be token ids, got {key[:20]!r}",
                    param="logit_bias",
                    code="invalid_value",
                )
            bias.append((int(key), value))
        return tuple(bias)


class Sampling(SamplingFields):
    """The fields shared by completions and chat completions."""

    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    min_tokens: Count = 0  # vLLM's

    @model_validator(mode="after")
    def _check_stream_options(self) -> Sampling:
        if self.stream_options is not None and not self.stream:
            raise unsupported("stream_options", "is only allowed with stream=true")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(Sampling):
    model: str
    prompt: (
        NonEmptyStr
        | TokenIds
        | Annotated[list[NonEmptyStr | TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    )
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    best_of: int | None = None
    logprobs: Count | None = None
    echo: bool = False
    suffix: str | None = None

    @model_validator(mode="after")
    def _reject_unimplemented_completion_fields(self) -> CompletionRequest:
        if self.best_of not in (None, 1):
            raise unsupported("best_of", "is not supported (vLLM V1 rejects it too): use n")
        if self.suffix:
            raise unsupported("suffix", "is not supported")
        return self

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


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def as_dict(self) -> dict[str, str]:
        """The message as the chat template sees it (templates may use `name`, as in vLLM)."""
        message = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(Sampling):
    model: str
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Count | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _reject_unimplemented_chat_fields(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise unsupported("top_logprobs", "needs logprobs=true")
        if self.tools or self.tool_choice not in (None, "none"):
            raise unsupported("tools", "tool calling is not supported yet")
        if self.response_format not in (None, {"type": "text"}):
            raise unsupported("response_format", "only text output is supported")
        return self

    def params(self) -> SamplingParams:
        return self.sampling_params(
            self.max_output_tokens,
            min_tokens=self.min_tokens,
            logprobs=(self.top_logprobs or 0) if self.logprobs else None,
        )

    def conversation(self) -> list[dict[str, str]]:
        return [m.as_dict() for m in self.messages]

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class NativeSamplingParams(SamplingFields):
    """SGLang's `sampling_params` object."""

    max_new_tokens: Annotated[int, Field(ge=1)] | None = 128
    # SGLang's defaults, and no null: unlike OpenAI's fields (SGLang allows a hotter temperature)
    temperature: Annotated[float, Field(ge=0.0, le=100.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = -1
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    min_new_tokens: Count = 0
    no_stop_trim: bool = False  # SGLang's: keep the matched stop string


class SessionParamsModel(Strict):
    """Which session a `/generate` continues, and from where (runtime/frontend/sessions.py)."""

    id: NonEmptyStr
    rid: NonEmptyStr | None = None
    offset: int | None = None
    replace: bool = False
    drop_previous_output: bool = False


class GenerateRequest(Strict):
    """SGLang's native `POST /generate`: one prompt, as `text` or as `input_ids`."""

    text: NonEmptyStr | None = None
    input_ids: TokenIds | None = None
    sampling_params: NativeSamplingParams = Field(default_factory=NativeSamplingParams)
    stream: bool = False
    rid: NonEmptyStr | None = None
    session_params: SessionParamsModel | None = None
    return_logprob: bool = False
    top_logprobs_num: Count = 0
    logprob_start_len: Annotated[int, Field(ge=-1, lt=2**31)] = -1
    return_text_in_logprobs: bool = False

    def session(self) -> SessionParams | None:
        p = self.session_params
        if p is None:
            return None
        return SessionParams(p.id, p.rid, p.offset, p.replace, p.drop_previous_output)

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise unsupported("text", "give exactly one of text or input_ids")
        return self

    def prompt(self) -> str | list[int]:
        return self.text if self.text is not None else list(self.input_ids or ())

    def logprob_start(self, num_prompt_tokens: int) -> int:
        """SGLang's `logprob_start_len`: -1 is the last prompt token."""
        start = self.logprob_start_len
        return num_prompt_tokens - 1 if start == -1 else start

    def params(self, num_prompt_tokens: int) -> SamplingParams:
        s = self.sampling_params
        more: dict[str, Any] = {"min_tokens": s.min_new_tokens}
        if s.no_stop_trim:
            more["include_stop_str_in_output"] = True
        if self.return_logprob:
            more["logprobs"] = self.top_logprobs_num
            start = self.logprob_start(num_prompt_tokens)
            if start >= num_prompt_tokens:
                raise APIError(
                    400,
                    f"logprob_start_len ({start}) must be below the prompt's length "
                    f"({num_prompt_tokens} tokens)",
                    param="logprob_start_len",
                    code="invalid_value",
                )
            if start + 1 < num_prompt_tokens:  # SGLang's first entry is always null
                more |= {
                    "prompt_logprobs": self.top_logprobs_num,
                    "prompt_logprobs_start": start + 1,
                }
        return s.sampling_params(s.max_new_tokens, **more)


class OpenSessionRequest(Strict):
    """SGLang's `POST /open_session`; answered by the session id."""

    capacity_of_str_len: Annotated[int, Field(ge=1, le=10_000_000)]
    session_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    timeout: Annotated[float, Field(gt=0)] | None = None


class CloseSessionRequest(Strict):
    """SGLang's `POST /close_session`."""

    session_id: str


class TokenizeRequest(Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise unsupported("prompt", "give exactly one of prompt or messages")
        return self


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]
