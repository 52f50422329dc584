"""Request bodies of SGLang's native routes (`/generate`, sessions), under the field policy of
api/http/fields.py, as SGLang's `GenerateReqInput` takes them: one prompt, or a batch (`text`
or `input_ids` as a list, with one `sampling_params` for all or one per item)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import Field, model_validator

from api.http.errors import APIError, unsupported
from api.http.fields import Body, Refusal, refusals
from api.routes.sampling_fields import (
    MAX_PROMPTS,
    SAMPLING_REFUSALS,
    Count,
    NonEmptyStr,
    Rid,
    SamplingFields,
    Seed,
    TokenIds,
)
from runtime.protocol import SamplingParams, SessionParams

NO_MEDIA = "images, video and audio are not supported"
Texts = Annotated[list[NonEmptyStr], Field(min_length=1, max_length=MAX_PROMPTS)]
TokenIdLists = Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
Rids = Annotated[list[Rid], Field(min_length=1, max_length=MAX_PROMPTS)]


class NativeSamplingParams(SamplingFields):
    """SGLang's `sampling_params` object."""

    no_ops = frozenset({"stream_interval"})  # every token is streamed as it comes
    refused_unless = refusals(
        SAMPLING_REFUSALS,
        custom_params=Refusal(({},), "custom parameters are not supported"),
        stop_regex=Refusal(([],), "stop regexes are not supported"),
    )
    max_new_tokens: Annotated[int, Field(ge=1)] | None = 128
    # SGLang's defaults (SGLang allows a hotter temperature than OpenAI)
    temperature: Annotated[float, Field(ge=0.0, le=100.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = -1
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    min_new_tokens: Count = 0
    no_stop_trim: bool = False  # SGLang's: keep the matched stop string
    sampling_seed: Seed | None = None  # SGLang's name for `seed`


class SessionParamsModel(Body):
    """Which session a `/generate` continues, and from where (runtime/frontend/sessions.py)."""

    id: Rid
    rid: Rid | None = None
    offset: int | None = None
    replace: bool = False
    drop_previous_output: bool = False


@dataclass(frozen=True, slots=True)
class GenerateItem:
    """One prompt of a `/generate` call, with its own sampling parameters and id."""

    prompt: str | list[int]
    sampling: NativeSamplingParams
    rid: str | None


class GenerateRequest(Body):
    """SGLang's native `POST /generate`."""

    no_ops = frozenset({"log_metrics", "modalities", "no_logs", "custom_labels", "extra_key"})
    refused_unless = refusals(
        image_data=Refusal(([], ""), NO_MEDIA),
        video_data=Refusal(([], ""), NO_MEDIA),
        audio_data=Refusal(([], ""), NO_MEDIA),
        input_embeds=Refusal((), "input embeddings are not supported"),
        lora_path=Refusal(("",), "LoRA adapters are not supported"),
        lora_id=Refusal(("",), "LoRA adapters are not supported"),
        token_ids_logprob=Refusal(([],), "is not supported"),
        return_hidden_states=Refusal((False,), "hidden states are not returned"),
        custom_logit_processor=Refusal(("",), "custom logits processors are not supported"),
        bootstrap_host=Refusal((), "prefill/decode disaggregation is not supported"),
        bootstrap_room=Refusal((), "prefill/decode disaggregation is not supported"),
        data_parallel_rank=Refusal((), "requests are routed by load"),
        priority=Refusal((0,), "requests are served first come, first served"),
    )
    text: NonEmptyStr | Texts | None = None
    input_ids: TokenIds | TokenIdLists | None = None
    sampling_params: (
        NativeSamplingParams
        | Annotated[list[NativeSamplingParams], Field(min_length=1, max_length=MAX_PROMPTS)]
    ) = Field(default_factory=NativeSamplingParams)
    stream: bool = False
    rid: Rid | Rids | None = None
    session_params: SessionParamsModel | None = None
    return_logprob: bool = False
    top_logprobs_num: Count = 0
    logprob_start_len: Annotated[int, Field(ge=-1, lt=2**31)] = -1
    return_text_in_logprobs: bool = False

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise unsupported("text", "give exactly one of text or input_ids")
        return self

    @property
    def is_batch(self) -> bool:
        """A list of texts, or a list of token-id lists (SGLang's batch)."""
        if isinstance(self.text, list):
            return True
        ids = self.input_ids
        return isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)

    def items(self) -> list[GenerateItem]:
        """Each prompt with its sampling parameters and id; 400s naming what does not fit."""
        prompts = self._prompts()
        params = _each(self.sampling_params, len(prompts), "sampling_params")
        rids = _each(self.rid, len(prompts), "rid")
        if self.is_batch and self.session_params is not None:
            raise unsupported("session_params", "is for one prompt, not a batch")
        return [
            GenerateItem(prompt, p, rid)
            for prompt, p, rid in zip(prompts, params, rids, strict=True)
        ]

    def _prompts(self) -> list[str | list[int]]:
        if self.text is not None:
            return [self.text] if isinstance(self.text, str) else list(self.text)
        ids: list[Any] = self.input_ids or []
        return list(ids) if self.is_batch else [ids]

    def session(self) -> SessionParams | None:
        p = self.session_params
        if p is None:
            return None
        return SessionParams(p.id, p.rid, p.offset, p.replace, p.drop_previous_output)

    def logprob_start(self, num_prompt_tokens: int) -> int:
        """SGLang's `logprob_start_len`: -1 is the last prompt token."""
        start = self.logprob_start_len
        return num_prompt_tokens - 1 if start == -1 else start

    def params(self, item: GenerateItem, num_prompt_tokens: int) -> SamplingParams:
        s = item.sampling
        more: dict[str, Any] = {"min_tokens": s.min_new_tokens}
        if s.sampling_seed is not None and s.seed is None:
            more["seed"] = s.sampling_seed
        if s.no_stop_trim:
            more["include_stop_str_in_output"] = True
        if self.return_logprob:
            more |= self._logprob_fields(num_prompt_tokens)
        return s.sampling_params(s.max_new_tokens, **more)

    def _logprob_fields(self, num_prompt_tokens: int) -> dict[str, Any]:
        start = self.logprob_start(num_prompt_tokens)
        if start >= num_prompt_tokens:
            raise APIError(
                400,
                f"logprob_start_len ({start}) must be below the prompt's length "
                f"({num_prompt_tokens} tokens)",
                param="logprob_start_len",
                code="invalid_value",
            )
        fields: dict[str, Any] = {"logprobs": self.top_logprobs_num}
        if start + 1 < num_prompt_tokens:  # SGLang's first entry is always null
            fields |= {"prompt_logprobs": self.top_logprobs_num, "prompt_logprobs_start": start + 1}
        return fields


def _each(value: Any, count: int, field: str) -> list[Any]:
    """A batch's per-item values: one given for all, or a list of exactly `count`."""
    if not isinstance(value, list):
        return [value] * count
    if len(value) != count:
        raise unsupported(field, f"has {len(value)} entries for {count} prompts")
    return value


class OpenSessionRequest(Body):
    """SGLang's `POST /open_session`; answered by the session id."""

    capacity_of_str_len: Annotated[int, Field(ge=1, le=10_000_000)]
    session_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    timeout: Annotated[float, Field(gt=0)] | None = None


class CloseSessionRequest(Body):
    """SGLang's `POST /close_session`."""

    session_id: Rid
