"""What every handler shares: the engine client, the settings, metrics, body parsing, and
starting requests (prompts validated, chats rendered)."""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from quart import g, request

from api.http.budget import DEFAULT_MAX_BODY, BodyBudget
from api.http.connections import ConnectionStats
from api.http.errors import APIError, from_validation_error
from api.http.fields import IgnoredLog, ignored_fields
from api.http.files import output_folder
from api.http.metrics import Metrics
from api.http.refusal_log import RefusalLog
from api.http.request_log import LogConfig, RequestLog
from runtime.protocol import (
    ControlClient,
    EngineClient,
    RequestOutput,
    SamplingParams,
    SessionParams,
    WeightsClient,
)

Model = TypeVar("Model", bound=BaseModel)
log = logging.getLogger("api")

RETRY = {"Retry-After": "1"}  # seconds: capacity frees up as requests end, usually soon
# Prompt log-probabilities one request may ask for, counted as positions times (top + 1):
# each is a few dozen bytes of answer, built and encoded on the event loop.
MAX_PROMPT_LOGPROB_ENTRIES = 2**17


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """Options of the HTTP layer.

    Attributes:
        served_model_name: the `model` clients must name.
        api_key: if set, required as `Authorization: Bearer <key>` (except /health, /metrics).
        max_open_requests: sequences the engine may work on at once (running or waiting);
            beyond it new requests get 503 until some finish.
        health_timeout: seconds the actors get to answer a /health ping.
        health_generate_timeout: seconds /health_generate waits for its one token.
        request_timeout: seconds a request may run before it ends with a 408 error (None:
            no limit).
        enable_control_api: serve the routes that steer the engine (pause, resume...).
        log_config: request logging and dumps at startup (api/request_log.py).
        strict_fields: refuse unknown request fields (400) instead of ignoring them
            (api/http/fields.py).
        output_root: where control routes may have files written (dumps, profiles): the
            folder itself or one directly in it (api/http/files.py).
        max_body_bytes: the byte limit of a body with prompts, at least (api/http/budget.py).
        cumulative_streaming_output: streamed /generate events carry the whole answer so
            far, as SGLang's do by default, instead of only what is new.
        tool_call_parser: how the model writes tool calls (api/tools/parsers.py), if set.
        enable_auto_tool_choice: let the model choose whether to call tools (tool_choice
            "auto"); needs tool_call_parser.
        max_embedding_inputs: inputs one embedding request may carry (OpenAI's cap: 2048).
    """

    served_model_name: str
    api_key: str | None = None
    max_open_requests: int = 4096
    health_timeout: float = 5.0
    health_generate_timeout: float = 20.0  # SGLang's default
    log_config: LogConfig = field(default_factory=LogConfig)
    request_timeout: float | None = None
    enable_control_api: bool = False
    strict_fields: bool = False
    output_root: Path = field(default_factory=Path.cwd)
    max_body_bytes: int = DEFAULT_MAX_BODY
    cumulative_streaming_output: bool = False
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    max_embedding_inputs: int = 2048


@dataclass(slots=True)
class ServerState:
    engine: EngineClient
    settings: ServerSettings
    budget: BodyBudget
    metrics: Metrics = field(init=False)
    request_log: RequestLog = field(init=False)
    connections: ConnectionStats = field(default_factory=ConnectionStats)
    draining: bool = False
    ignored_log: IgnoredLog = field(default_factory=IgnoredLog)
    refusals: RefusalLog = field(default_factory=lambda: RefusalLog(log))

    def __post_init__(self) -> None:
        self.metrics = Metrics(self.engine, self.connections, self.settings.served_model_name)
        self.request_log = RequestLog(self.settings.log_config)

    @property
    def control(self) -> ControlClient:
        return self.engine.control

    @property
    def weights(self) -> WeightsClient:
        return self.engine.weights

    async def parse(self, model: type[Model], *, optional: bool = False) -> Model:
        """The request's JSON body as `model`, or an APIError(400) naming what is wrong. An
        `optional` body may be empty (every field has its default)."""
        raw = await request.get_data()
        if optional and not raw.strip():
            raw = b"{}"
        try:
            body = json.loads(raw)
        except RecursionError:
            raise APIError(400, "the body is nested too deeply", code="invalid_json") from None
        except ValueError as exc:  # bad JSON, bad UTF-8, or an integer of over 4300 digits
            raise APIError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object", code="invalid_json")
        g.body = body  # for the request log
        try:
            parsed = model.model_validate(body)
        except ValidationError as exc:
            raise from_validation_error(exc) from None
        self.check_ignored(ignored_fields(parsed))
        return parsed

    def query(self, model: type[Model]) -> Model:
        """The request's query parameters as `model` (their values are strings: its fields
        coerce them), under the same policy as bodies."""
        args = {key: request.args.getlist(key) for key in request.args}
        params = {key: values[0] if len(values) == 1 else values for key, values in args.items()}
        try:
            parsed = model.model_validate(params)
        except ValidationError as exc:
            raise from_validation_error(exc) from None
        self.check_ignored(ignored_fields(parsed))
        return parsed

    def check_ignored(self, names: list[str]) -> None:
        """Unknown fields: a 400 under --strict-fields; else logged once per route and key,
        and named in the answer's X-Ignored-Fields header."""
        if not names:
            return
        if self.settings.strict_fields:
            first = names[0]
            raise APIError(400, f"unknown field {first!r}", param=first, code="unknown_parameter")
        g.ignored_fields = [*g.get("ignored_fields", ()), *names]
        new = self.ignored_log.first_time(request.path, names)
        if new:
            log.info("%s: ignored unknown fields %s", request.path, ", ".join(new))

    def output_folder(self, requested: str | None, prefix: str) -> str:
        """The folder a control route may write into: the one asked for, if the output root
        allows it, or a new private one in the root; a 400 naming why not."""
        root = self.settings.output_root.resolve()
        try:
            if requested is None:
                return tempfile.mkdtemp(prefix=prefix, dir=root)
            return str(output_folder(root, requested))
        except (ValueError, OSError) as exc:
            raise APIError(400, str(exc), param="output_dir", code="invalid_value") from None

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.settings.served_model_name:
            raise APIError(
                404, f"The model `{name}` does not exist.", param="model", code="model_not_found"
            )

    def admit(self, num_sequences: int = 1) -> None:
        """Refuse new work while draining or over capacity (503: clients should retry).

        Capacity counts sequences: a completion with 50 prompts is 50 open requests. It counts
        the ones the engine still generates for: a client that stops reading a finished stream
        must not hold a slot, or a few such clients would lock everyone out.
        """
        limit = self.settings.max_open_requests
        if num_sequences > limit:
            raise APIError(
                400,
                f"{num_sequences} sequences (prompts times n) in one request, but this server "
                f"runs at most {limit} at once",
                param="prompt",
                code="too_many_prompts",
            )
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down", headers=RETRY)
        if self.engine.statistics().frontend.num_requests_generating + num_sequences > limit:
            raise APIError(
                503, "the server is overloaded; retry later", code="overloaded", headers=RETRY
            )

    async def start(
        self,
        prompts: Sequence[str | list[int]],
        params: SamplingParams | Sequence[SamplingParams],
        rids: list[str],
        session: SessionParams | None = None,
    ) -> list[AsyncGenerator[RequestOutput, None]]:
        """Validate every prompt (with its params, or the one `params` for all) before any is
        queued, structured-output constraints compiled; a bad one is a 400 for the whole
        request, as is a rid given twice."""
        timeout = self.settings.request_timeout
        each = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(set(rids)) < len(rids):
            raise APIError(
                400, "rid: the same rid is given twice", param="rid", code="invalid_value"
            )
        check_prompt_logprobs(prompts, each)
        try:
            for constraint in {p.constraint for p in each if p.constraint is not None}:
                await self.engine.compile_constraint(constraint)
            streams = [
                self.engine.generate(prompt, p, rid=rid, timeout=timeout, session=session)
                for prompt, p, rid in zip(prompts, each, rids, strict=True)
            ]
        except ValueError as exc:
            code = "context_length_exceeded" if "context" in str(exc) else "invalid_value"
            raise APIError(400, str(exc), code=code) from None
        if self.request_log.active:
            entry = self.request_log.begin(request.path, g.get("body", {}), rids)
            streams = [self.request_log.observe(s, entry, i) for i, s in enumerate(streams)]
        return streams

    async def encode(self, text: str, *, param: str, add_special_tokens: bool = True) -> list[int]:
        """The text's token ids, or a 400 naming `param` (off the event loop if it is long)."""
        try:
            return await self.engine.tokenize(text, add_special_tokens=add_special_tokens)
        except ValueError as exc:  # not text (a lone surrogate), or it cannot fit the context
            code = "context_length_exceeded" if "context" in str(exc) else "invalid_value"
            raise APIError(400, str(exc), param=param, code=code) from None

    async def encode_all(
        self, prompts: Sequence[str | list[int]], add_special_tokens: bool = True
    ) -> list[list[int]]:
        return [
            p if isinstance(p, list) else await self.encode(p, param="prompt",
                                                            add_special_tokens=add_special_tokens)
            for p in prompts
        ]  # fmt: skip

    async def chat_text(
        self,
        conversation: list[dict[str, Any]],
        template_kwargs: Mapping[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        try:
            return await self.engine.apply_chat_template(conversation, template_kwargs, tools)
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from None

    async def chat_prompt(
        self,
        conversation: list[dict[str, Any]],
        template_kwargs: Mapping[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        # the template already holds whatever special tokens (BOS...) the model wants
        text = await self.chat_text(conversation, template_kwargs, tools)
        return await self.encode(text, param="messages", add_special_tokens=False)


def check_prompt_logprobs(
    prompts: Sequence[str | list[int]], params: Sequence[SamplingParams]
) -> None:
    """A 400 if the prompts' log-probabilities would make an answer over
    MAX_PROMPT_LOGPROB_ENTRIES: echo with logprobs over many prompts is a small request
    with a very large answer."""
    entries = sum(
        max(len(prompt) - p.prompt_logprobs_start, 0) * (p.prompt_logprobs + 1)
        for prompt, p in zip(prompts, params, strict=True)
        if p.prompt_logprobs is not None
    )
    if entries > MAX_PROMPT_LOGPROB_ENTRIES:
        raise APIError(
            400,
            f"the prompts' log-probabilities would be {entries} entries (positions times "
            f"logprobs + 1), at most {MAX_PROMPT_LOGPROB_ENTRIES} in one request: send fewer "
            "prompts per request, or ask for fewer log-probabilities",
            param="logprobs",
            code="answer_too_large",
        )
