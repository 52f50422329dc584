"""The routes of TRL's own server (`trl vllm-serve`, trailing slashes and all), which TRL's
`VLLMClient` (trl/generation/vllm_client.py) calls during GRPO: health, world size,
generation and chat (token ids and log-probabilities out), and the prefix-cache reset.

TRL pushes new weights through an NCCL group of its own (`/init_communicator/`,
`/update_named_param/`): that is refused with a 400 that says what to use instead, SGLang's
`/init_weights_update_group` and `/update_weights_from_distributed` (docs/rl-frameworks.md).
"""

from __future__ import annotations

import uuid
from functools import partial
from typing import Annotated, Any

import trio
from pydantic import Field, model_validator
from quart import Response, jsonify
from quart_trio import QuartTrio

from api.http.errors import APIError
from api.http.fields import Refusal, refusals
from api.http.state import ServerState
from api.http.streaming import Collected, collect_all
from api.routes.guard import control_routes
from api.routes.openai_schemas import MAX_MESSAGES, Messages
from api.routes.sampling_fields import MAX_PROMPTS, Count, NonEmptyStr, SamplingFields, TokenIds
from api.routes.structured_fields import Source, Spelling
from runtime.protocol import Constraint, SamplingParams

NCCL_ONLY = (
    "TRL's NCCL weight sync is not supported: join with /init_weights_update_group and send "
    "the weights with /update_weights_from_distributed (docs/rl-frameworks.md)"
)


class TRLSampling(SamplingFields):
    """What TRL's client sends beside its prompts (trl/scripts/vllm_serve.py's defaults)."""

    refused_unless = refusals(
        images=Refusal(([],), "images are not supported"),
        generation_kwargs=Refusal(({},), "extra generation arguments are not supported"),
    )
    max_tokens: Annotated[int, Field(ge=1)] = 16
    logprobs: Count | None = 0
    structured_outputs_regex: Source | None = None

    def spellings(self) -> list[Spelling]:
        regex = self.structured_outputs_regex
        found = super().spellings()
        if regex is not None:
            found.append(("structured_outputs_regex", partial(Constraint, "regex", regex)))
        return found

    def params(self) -> SamplingParams:
        return self.sampling_params(self.max_tokens, logprobs=self.logprobs or 0)


class TRLGenerateRequest(TRLSampling):
    prompts: (
        Annotated[list[NonEmptyStr], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    )


class TRLChatRequest(TRLSampling):
    refused_unless = refusals(
        TRLSampling.refused_unless, tools=Refusal(([],), "tool calling is not supported yet")
    )
    messages: Annotated[list[Messages], Field(min_length=1, max_length=MAX_PROMPTS)]
    chat_template_kwargs: Annotated[dict[str, Any], Field(max_length=32)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _count_messages(cls, body: Any) -> Any:
        """All conversations together hold at most MAX_MESSAGES: counted before any is
        validated, which is what costs."""
        conversations = body.get("messages") if isinstance(body, dict) else None
        if isinstance(conversations, list) and len(conversations) <= MAX_PROMPTS:
            total = sum(len(c) for c in conversations if isinstance(c, list))
            if total > MAX_MESSAGES:
                raise APIError(400, f"messages: {total} in all, at most {MAX_MESSAGES}",
                               param="messages", code="too_many_messages")  # fmt: skip
        return body


def register(app: QuartTrio, state: ServerState) -> None:
    route = control_routes(app, state)

    @app.get("/health/")
    async def trl_health() -> Response:
        with trio.move_on_after(state.settings.health_timeout):
            await state.engine.check_health()
            return jsonify({"status": "ok"})
        raise APIError(503, "the engine did not answer in time", code="unhealthy")

    @app.get("/get_world_size/")
    async def trl_world_size() -> Response:
        info = state.engine.server_info()
        size = info.get("tensor_parallel_size", 1) * info.get("data_parallel_size", 1)
        return jsonify({"world_size": size})

    @app.post("/generate/")
    async def trl_generate() -> Response:
        req = await state.parse(TRLGenerateRequest)
        prompts = await state.encode_all(list(req.prompts))
        return await answer(state, req, prompts)

    @app.post("/chat/")
    async def trl_chat() -> Response:
        req = await state.parse(TRLChatRequest)
        conversations = [[m.as_dict() for m in chat] for chat in req.messages]
        prompts = [await state.chat_prompt(c, req.chat_template_kwargs) for c in conversations]
        return await answer(state, req, prompts)

    @route("/reset_prefix_cache/")
    async def trl_reset_prefix_cache() -> Response:
        try:
            await state.control.flush_cache()
        except ValueError:
            return jsonify({"message": "Request received, resetting prefix cache status: False"})
        return jsonify({"message": "Request received, resetting prefix cache status: True"})

    async def nccl_only() -> Response:
        raise APIError(400, NCCL_ONLY, code="unsupported")

    for rule in ("/init_communicator/", "/update_named_param/", "/close_communicator/"):
        app.add_url_rule(rule, f"trl{rule}", nccl_only, methods=["POST"])


async def answer(state: ServerState, req: TRLSampling, prompts: list[list[int]]) -> Response:
    """TRL's shape: each prompt's ids, then every completion (prompt by prompt, `n` each) with
    its log-probabilities per token: the sampled token's, then the most likely ones'."""
    params = req.params()
    state.admit(len(prompts) * params.n)
    rids = [f"trl-{uuid.uuid4().hex}" for _ in prompts]
    streams = await state.start(prompts, params, rids)
    results = await collect_all(streams, state.metrics, params.n)
    lists = [token_logprobs(r) for r in results]
    return jsonify(
        {
            "prompt_ids": prompts,
            "completion_ids": [r.token_ids for r in results],
            "logprobs": [[[lp for _, lp in token] for token in r] for r in lists],
            "logprob_token_ids": [[[i for i, _ in token] for token in r] for r in lists],
        }
    )


def token_logprobs(result: Collected) -> list[list[tuple[int, float]]]:
    """Per token: (id, log-probability) of the sampled one, then of the most likely others."""
    tops = result.top_logprobs or [()] * len(result.token_ids)
    return [
        [(token, logprob), *[(i, lp) for i, lp in top if i != token]]
        for token, logprob, top in zip(result.token_ids, result.logprobs, tops, strict=True)
    ]
