"""Embedding calls in the frontend: inputs checked and tokenized, pooling parameters resolved,
and the inputs' vectors collected (`Engine.embed` runs them).

Every check raises FieldError naming the field before anything is queued, so a bad input
never reaches an actor. What the worker computes (runtime/worker/pooling.py) is the vector
already cut and normalized; here it is only collected, in input order.
"""

from __future__ import annotations

from collections.abc import Sequence

import trio
from transformers import PretrainedConfig

from runtime.config.errors import FieldError
from runtime.config.pooling import PoolingParams
from runtime.config.sampling import SamplingParams
from runtime.frontend.inputs import InputProcessor
from runtime.frontend.request_stream import RequestStream, Signal
from runtime.protocol import Embedding, RequestAbortedError
from runtime.wire.messages import AddRequest


def matryoshka_dimensions(hf_config: PretrainedConfig) -> tuple[int, ...] | None:
    """The dimensions a model's config allows for `dimensions` (as vLLM reads them):
    None if it declares no matryoshka representation, () if it allows any."""
    declared = getattr(hf_config, "matryoshka_dimensions", None)
    if declared:
        return tuple(int(d) for d in declared)
    return () if getattr(hf_config, "is_matryoshka", False) else None


class EmbeddingInputs:
    """An embedding call's inputs as token ids, and its pooling parameters, checked against
    the model and the engine's defaults."""

    def __init__(
        self,
        inputs: InputProcessor,
        hf_config: PretrainedConfig,
        default_pooling: str,
        max_model_len: int,
    ) -> None:
        self.inputs = inputs
        self.default_pooling = default_pooling
        self.max_model_len = max_model_len
        self.hidden_size = int(hf_config.hidden_size)
        self.matryoshka = matryoshka_dimensions(hf_config)

    def resolve(self, params: PoolingParams) -> PoolingParams:
        """`params` with the engine's default pooling type and an explicit truncation."""
        if not params.pooling_type:
            params = params.replace(pooling_type=self.default_pooling)
        if params.dimensions is not None:
            self._check_dimensions(params.dimensions)
        truncate = params.truncate_prompt_tokens
        if truncate == -1:
            params = params.replace(truncate_prompt_tokens=self.max_model_len)
        elif truncate is not None and truncate > self.max_model_len:
            raise FieldError(
                "truncate_prompt_tokens",
                f"truncate_prompt_tokens value ({truncate}) is greater than max_model_len "
                f"({self.max_model_len}). Please, select a smaller truncation size.",
            )  # vLLM's words
        return params

    def _check_dimensions(self, dimensions: int) -> None:
        if self.matryoshka is None:  # vLLM's words
            raise FieldError(
                "dimensions",
                "this model does not support matryoshka representation, changing output "
                "dimensions will lead to poor results",
            )
        if self.matryoshka and dimensions not in self.matryoshka:
            raise FieldError(
                "dimensions",
                f"this model only supports {list(self.matryoshka)} matryoshka dimensions, "
                "use other output dimensions will lead to poor results",
            )
        if dimensions > self.hidden_size:
            raise FieldError(
                "dimensions", f"must be at most the model's hidden size ({self.hidden_size})"
            )

    async def token_ids(
        self,
        inputs: Sequence[str | Sequence[int]],
        params: PoolingParams,
        add_special_tokens: bool = True,
    ) -> list[tuple[int, ...]]:
        """Each input's token ids, truncated as `params` (resolved) asks."""
        if isinstance(inputs, str) or not isinstance(inputs, Sequence):
            raise FieldError("inputs", "must be a list of texts or of token-id lists")
        if not inputs:
            raise FieldError("inputs", "must not be empty")
        prompts = []
        for i, item in enumerate(inputs):
            token_ids = await self._token_ids(f"inputs[{i}]", item, add_special_tokens)
            prompts.append(self._fit(f"inputs[{i}]", token_ids, params))
        return prompts

    async def _token_ids(
        self, field: str, item: object, add_special_tokens: bool
    ) -> tuple[int, ...]:
        if isinstance(item, str):
            if not item:
                raise FieldError(field, "must not be an empty string")
            try:
                token_ids = tuple(await self.inputs.tokenize_async(item, add_special_tokens))
            except ValueError as exc:  # not Unicode, or far over the context
                raise FieldError(field, str(exc)) from None
            if not token_ids:
                raise FieldError(field, "the text has no tokens")
            return token_ids
        if not isinstance(item, Sequence):
            raise FieldError(field, "must be a text or a list of token ids")
        vocab = self.inputs.vocab_size
        bad = [t for t in item if not (type(t) is int and 0 <= t < vocab)]
        if bad:
            raise FieldError(field, f"token ids must be ints in [0, {vocab}), got {bad[:5]}")
        if not item:
            raise FieldError(field, "must not be an empty list")
        return tuple(item)

    def _fit(
        self, field: str, token_ids: tuple[int, ...], params: PoolingParams
    ) -> tuple[int, ...]:
        """The last `truncate_prompt_tokens` tokens (vLLM's side), or all if they fit."""
        if params.truncate_prompt_tokens is not None:
            token_ids = token_ids[-params.truncate_prompt_tokens :]
        if len(token_ids) > self.max_model_len:
            raise FieldError(
                field,
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {len(token_ids)} tokens in the input for embedding "
                "generation. Please reduce the length of the input.",
            )  # vLLM's words; truncate_prompt_tokens cuts it instead
        return token_ids


class EmbeddingCall:
    """The requests of one `embed` call (one per input), served by the calling task: their
    streams share a `Signal`, so it wakes when any input has its vector."""

    def __init__(self, order: int, prompts: list[tuple[int, ...]], params: PoolingParams) -> None:
        nothing = SamplingParams()  # nothing is sampled: the defaults, which ask nothing
        self.adds = [
            AddRequest(f"{order}.{i}", ids, 1, nothing, pooling=params)
            for i, ids in enumerate(prompts)
        ]
        self.signal = Signal()
        self.streams = [RequestStream(self.signal) for _ in self.adds]

    async def results(self) -> list[Embedding]:
        """Every input's vector, in input order, once all have come. Raises an input's
        error (the engine died, the scheduler refused it), or RequestAbortedError if one
        was aborted."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while not all(stream.finished for stream in self.streams):
            await self.signal.wait()
        outputs = [stream.take() for stream in self.streams]  # raises a failed one's error
        if any(out.embedding is None for out in outputs):
            raise RequestAbortedError("the request was aborted before every input was embedded")
        return [
            Embedding(i, out.embedding, len(add.prompt_token_ids), out.num_cached_tokens)
            for i, (add, out) in enumerate(zip(self.adds, outputs, strict=True))
            if out.embedding is not None
        ]
