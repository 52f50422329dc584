"""The field policy (api/http/fields.py) on every route that takes a body, against the fake
engine: unknown keys are ignored and named, `null` is the default, documented no-ops pass,
and a field whose value cannot be honoured is a 400 naming it."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pydantic import BaseModel
from quart.typing import TestClientProtocol as QuartClient

from api.app import create_app
from api.http.fields import MAX_REPORTED, Body
from api.http.state import ServerSettings
from api.routes import control as control_api
from api.routes.native_schemas import NativeSamplingParams
from api.routes.openai_schemas import ChatMessage, StreamOptions
from api.routes.openapi import BODIES
from tests.api_helpers import MODEL
from tests.fake_engine import FakeEngine

COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
GENERATE = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}


async def served(engine: FakeEngine, **settings: Any) -> AsyncIterator[QuartClient]:
    config = ServerSettings(served_model_name=MODEL, enable_control_api=True, **settings)
    async with create_app(engine, config).test_app() as test_app:
        yield test_app.test_client()


@pytest.fixture
async def lenient(engine: FakeEngine) -> AsyncIterator[QuartClient]:
    async for client in served(engine):
        yield client


@pytest.fixture
async def strict(engine: FakeEngine) -> AsyncIterator[QuartClient]:
    async for client in served(engine, strict_fields=True):
        yield client


@pytest.mark.parametrize(
    ("path", "body", "named"),
    [
        ("/v1/completions", COMPLETION | {"frobnicate": 1}, "frobnicate"),
        ("/v1/completions", COMPLETION | {"stream": True, "stream_options": {"x": 1}},
         "stream_options.x"),
        ("/v1/chat/completions", CHAT | {"messages": [{"role": "user", "content": "a", "y": 2}]},
         "messages[0].y"),
        ("/generate", GENERATE | {"sampling_params": {"max_new_tokens": 2, "temprature": 0}},
         "sampling_params.temprature"),
        ("/pause_generation", {"mode": "keep", "extra": 1}, "extra"),
    ],
)  # fmt: skip
async def test_unknown_fields_are_ignored_named_and_logged_once(
    lenient: QuartClient, path: str, body: dict, named: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="api"):
        for _ in range(2):
            response = await lenient.post(path, json=body)
            await response.get_data()
            assert response.status_code == 200, await response.get_data()
            assert response.headers["X-Ignored-Fields"] == named
    assert [r.message for r in caplog.records if named in r.message] == [
        f"{path}: ignored unknown fields {named}"
    ]


@pytest.mark.parametrize(
    ("path", "body", "named"),
    [
        ("/v1/completions", COMPLETION | {"frobnicate": 1}, "frobnicate"),
        ("/generate", GENERATE | {"sampling_params": {"temprature": 0}},
         "sampling_params.temprature"),
    ],
)  # fmt: skip
async def test_strict_fields_makes_them_400s(
    strict: QuartClient, path: str, body: dict, named: str
) -> None:
    response = await strict.post(path, json=body)
    error = (await response.get_json())["error"]
    assert response.status_code == 400 and error["param"] == named
    assert error["code"] == "unknown_parameter"


async def test_a_known_field_needs_no_header(lenient: QuartClient) -> None:
    response = await lenient.post("/v1/completions", json=COMPLETION | {"user": "u"})
    assert response.status_code == 200 and "X-Ignored-Fields" not in response.headers


async def test_null_is_the_default_for_every_optional_field(lenient: QuartClient) -> None:
    names = ["temperature", "stream", "n", "echo", "stop", "logprobs", "ignore_eos", "min_tokens"]
    nulls = dict.fromkeys([*names, "image_data"])
    response = await lenient.post("/v1/completions", json=COMPLETION | nulls)
    assert response.status_code == 200, await response.get_json()
    native = GENERATE | {"image_data": None, "lora_path": None, "rid": None, "stream": None}
    native["sampling_params"] = {"max_new_tokens": 2, "temperature": None, "top_k": None}
    response = await lenient.post("/generate", json=native)
    assert response.status_code == 200, await response.get_json()


async def test_the_header_is_bounded_and_safe(lenient: QuartClient) -> None:
    body = COMPLETION | {f"k{i}": i for i in range(40)} | {"a\nb,c\u00e9": 1, "z" * 300: 1}
    response = await lenient.post("/v1/completions", json=body)
    header = response.headers["X-Ignored-Fields"]
    assert response.status_code == 200 and "\n" not in header
    assert header.count(", ") == MAX_REPORTED and header.endswith("(26 more)")


def bodies() -> list[tuple[str, type[BaseModel]]]:
    routes = BODIES | control_api.BODIES
    return [(path, schema) for path, (schema, _) in routes.items()]


@pytest.mark.parametrize(("path", "schema"), bodies(), ids=[p for p, _ in bodies()])
async def test_every_refused_field_is_a_400_naming_it_at_another_value(
    lenient: QuartClient, path: str, schema: type[BaseModel]
) -> None:
    """A value the engine cannot honour is never dropped silently (checked on the body's
    top level, each table's every entry)."""
    assert issubclass(schema, Body)
    for name, refusal in schema.refused_unless.items():
        assert name not in schema.model_fields, f"{name} is a field and a refusal"
        value = {"not": "accepted"}
        assert value not in refusal.accepted
        response = await lenient.post(path, json={name: value})
        error = (await response.get_json())["error"]
        assert response.status_code == 400 and error["param"] == name, (name, error)
        assert error["code"] == "unsupported_parameter"
        assert refusal.why in error["message"]


@pytest.mark.parametrize(
    ("path", "body", "schema", "at"),
    [
        ("/v1/chat/completions", CHAT, ChatMessage, "messages[0]"),
        ("/v1/completions", COMPLETION | {"stream": True}, StreamOptions, "stream_options"),
        ("/generate", GENERATE, NativeSamplingParams, "sampling_params"),
    ],
)
async def test_nested_refusals_are_named_by_their_path(
    lenient: QuartClient, path: str, body: dict, schema: type[Body], at: str
) -> None:
    for name in schema.refused_unless:
        nested = {"role": "user", "content": "a"} if schema is ChatMessage else {}
        nested[name] = {"not": "accepted"}
        outer, _, index = at.partition("[")
        sent = body | {outer: [nested] if index else nested}
        response = await lenient.post(path, json=sent)
        error = (await response.get_json())["error"]
        assert response.status_code == 400 and error["param"] == f"{at}.{name}", (name, error)
