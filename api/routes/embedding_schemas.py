"""Request bodies of the embedding routes, under the field policy of api/http/fields.py:
OpenAI's `/v1/embeddings` with vLLM's extensions (`EmbeddingCompletionRequest`), and
SGLang's native `/encode` (`EmbeddingReqInput`)."""

from __future__ import annotations

import uuid
from typing import Annotated, Literal

from pydantic import Field, model_validator

from api.http.errors import APIError, unsupported
from api.http.fields import Body, Refusal, refusals
from api.routes.openai_schemas import OPENAI_NO_OPS
from api.routes.sampling_fields import NonEmptyStr, Rid, TokenIds
from runtime.protocol import FieldError, PoolingParams

Texts = Annotated[list[NonEmptyStr], Field(min_length=1)]
TokenIdLists = Annotated[list[TokenIds], Field(min_length=1)]
# One input or several, each a text or token ids: OpenAI's `input` (the count is checked
# against --max-embedding-inputs by the route, which knows the server's setting).
Inputs = NonEmptyStr | TokenIds | Texts | TokenIdLists
NO_MEDIA = "images, video and audio are not supported"


class PoolingFields(Body):
    """How to pool, as both routes take it: vLLM's names where vLLM has the field
    (`normalize`, `truncate_prompt_tokens`; `pooling_type` is the name of vLLM's server-side
    pooler setting, taken here per request)."""

    dimensions: Annotated[int, Field(ge=1)] | None = None
    normalize: bool = True
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    pooling_type: Literal["last", "mean", "cls"] | None = None

    def pooling_params(self) -> PoolingParams:
        try:
            return PoolingParams(
                pooling_type=self.pooling_type or "",
                normalize=self.normalize,
                dimensions=self.dimensions,
                truncate_prompt_tokens=self.truncate_prompt_tokens,
            )
        except FieldError as exc:
            raise unsupported(exc.field, exc.reason) from None


class EmbeddingRequest(PoolingFields):
    """OpenAI's `POST /v1/embeddings`, with vLLM's extra fields."""

    no_ops = OPENAI_NO_OPS  # `user` among them
    refused_unless = refusals(
        messages=Refusal((), "chat embeddings are not supported yet: send the text as input"),
        embed_dtype=Refusal(("float32",), "only float32 embeddings are returned"),
        endianness=Refusal(("native", "little"), "embeddings are little-endian float32"),
        priority=Refusal((0,), "requests are served first come, first served"),
    )
    model: str | None = None
    input: Inputs
    encoding_format: Literal["float", "base64"] = "float"
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS on a text input

    def inputs(self) -> list[str | list[int]]:
        """One entry per embedding: a text, or a list of token ids."""
        return _as_list(self.input)


class EncodeRequest(PoolingFields):
    """SGLang's native `POST /encode`: `text` or `input_ids`, one input or a batch."""

    no_ops = frozenset({"sampling_params", "log_metrics", "modalities", "routing_key"})
    refused_unless = refusals(
        image_data=Refusal(([], ""), NO_MEDIA),
        video_data=Refusal(([], ""), NO_MEDIA),
        audio_data=Refusal(([], ""), NO_MEDIA),
        input_embeds=Refusal((), "input embeddings are not supported"),
        lora_path=Refusal(("",), "LoRA adapters are not supported"),
        is_cross_encoder_request=Refusal((False,), "cross-encoder scoring is not supported"),
        priority=Refusal((0,), "requests are served first come, first served"),
    )
    text: NonEmptyStr | Texts | None = None
    input_ids: TokenIds | TokenIdLists | None = None
    rid: Rid | Annotated[list[Rid], Field(min_length=1)] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> EncodeRequest:
        if (self.text is None) == (self.input_ids is None):
            raise unsupported("text", "give exactly one of text or input_ids")
        return self

    @property
    def field(self) -> str:
        return "text" if self.text is not None else "input_ids"

    @property
    def is_batch(self) -> bool:
        given = self.text if self.text is not None else self.input_ids
        return isinstance(given, list) and isinstance(given[0], str | list)

    def inputs(self) -> list[str | list[int]]:
        given = self.text if self.text is not None else self.input_ids
        assert given is not None
        return _as_list(given)

    def rids(self, count: int) -> list[str]:
        """The caller's id of each input (or new ones), echoed in its `meta_info`."""
        given = [self.rid] if isinstance(self.rid, str) else self.rid
        if given is None:
            return [uuid.uuid4().hex for _ in range(count)]
        if len(given) != count:
            raise APIError(
                400, f"rid: {len(given)} ids for {count} inputs", param="rid", code="invalid_value"
            )
        return list(given)


def _as_list(given: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(given, str):
        return [given]
    if all(isinstance(x, int) for x in given):
        return [given]  # type: ignore[list-item]
    return list(given)  # type: ignore[arg-type]
