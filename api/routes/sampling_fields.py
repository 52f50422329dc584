"""The sampling fields every generation route shares, as OpenAI's, vLLM's and SGLang's APIs
all spell them; the caps on what a client controls."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from api.http.errors import APIError
from api.http.fields import Refusal, refusals
from api.routes.structured_fields import StructuredFields
from runtime.protocol import SamplingParams

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
# Strings the server keeps and repeats (request ids, names, paths): capped, as any echo is.
Rid = Annotated[str, Field(min_length=1, max_length=256)]
Name = Annotated[str, Field(min_length=1, max_length=1024)]
PathText = Annotated[str, Field(min_length=1, max_length=4096)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_LENGTH)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
Seed = Annotated[int, Field(ge=-(2**63), lt=2**64)]  # what the sampler's 64-bit hash takes
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]
Count = Annotated[int, Field(ge=0, lt=2**31)]  # n, logprobs...: the engine applies its limits
TokenId = Annotated[int, Field(ge=0, lt=2**31)]


# What the routes of all three APIs may carry that this engine cannot honour at another value.
SAMPLING_REFUSALS = refusals(
    use_beam_search=Refusal((False,), "beam search is not supported"),
    length_penalty=Refusal((1, 1.0), "is a beam search parameter: beam search is not supported"),
    logits_processors=Refusal(([],), "custom logits processors are not supported"),
    custom_logit_processor=Refusal(("",), "custom logits processors are not supported"),
    lora_path=Refusal(("",), "LoRA adapters are not supported"),
    lora_request=Refusal((), "LoRA adapters are not supported"),
    return_hidden_states=Refusal((False,), "hidden states are not returned"),
    priority=Refusal((0,), "requests are served first come, first served"),
)


class SamplingFields(StructuredFields):
    """How to sample, as OpenAI's, vLLM's and SGLang's APIs all spell it; null means default
    (structured output's fields: api/routes/structured_fields.py)."""

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
            constraint=self.constraint(),
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
