"""The HTTP layer against a fake engine: every error path, and the server carries on."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio
import trio.testing
from quart.typing import TestClientProtocol as QuartClient

from api.app import create_app
from api.http.state import ServerSettings
from tests.api_helpers import MODEL, sse_payloads
from tests.fake_engine import FakeEngine

BAD_REQUESTS = [
    # (method, path, body, status, param, code)
    ("POST", "/v1/completions", b"{not json", 400, None, "invalid_json"),
    ("POST", "/v1/completions", b"[1, 2]", 400, None, "invalid_json"),
    ("POST", "/v1/completions", {"prompt": "hi"}, 400, "model", "invalid_value"),
    ("POST", "/v1/completions", {"model": MODEL}, 400, "prompt", "invalid_value"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": 5}, 400, "prompt", "invalid_value"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt", "invalid_value"),
    (
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": [1, -2]},
        400,
        "prompt[1]",
        "invalid_value",
    ),
    (
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "max_tokens": "5"},
        400,
        "max_tokens",
        "invalid_value",
    ),
    (
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "max_tokens": 0},
        400,
        "max_tokens",
        "invalid_value",
    ),
    (
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "temperature": -1},
        400,
        "temperature",
        "invalid_value",
    ),
    (
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "top_p": 1.5},
        400,
        "top_p",
        "invalid_value",
    ),
    (
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "stream": "yes"},
        400,
        "stream",
        "invalid_value",
    ),
    (
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "stop": [""]},
        400,
        "stop[0]",
        "invalid_value",
    ),
    (
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "n": 0},
        400,
        "n",
        "invalid_value",
    ),
    (
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "best_of": 3},
        400,
        "best_of",
        "unsupported_parameter",
    ),
    (
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "logprobs": -1},
        400,
        "logprobs",
        "invalid_value",
    ),
    (
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "presence_penalty": 2.5},
        400,
        "presence_penalty",
        "invalid_value",
    ),
    (
        "POST",
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": "hi",
            "stream": True,
            "stream_options": {"continuous_usage_stats": True},
        },
        400,
        "stream_options.continuous_usage_stats",
        "unsupported_parameter",
    ),
    (
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "guided_json": {"type": "object"}, "regex": "a+"},
        400,
        "guided_json",
        "invalid_value",
    ),
    (
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": "x" * 64},
        400,
        None,
        "context_length_exceeded",
    ),
    (
        "POST",
        "/v1/completions",
        {"model": "other", "prompt": "hi"},
        404,
        "model",
        "model_not_found",
    ),
    (
        "POST",
        "/v1/chat/completions",
        {"model": MODEL, "messages": []},
        400,
        "messages",
        "invalid_value",
    ),
    (
        "POST",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "bot"}]},
        400,
        "messages[0].role",
        "invalid_value",
    ),
    (
        "POST",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        400,
        "top_logprobs",
        "unsupported_parameter",
    ),
    (
        "POST",
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function"}],
        },
        400,
        "tools[0].function",
        "invalid_value",
    ),
    ("POST", "/generate", {"sampling_params": {}}, 400, "text", "unsupported_parameter"),
    (
        "POST",
        "/generate",
        {"text": "a", "sampling_params": {"max_new_tokens": -1}},
        400,
        "sampling_params.max_new_tokens",
        "invalid_value",
    ),
    (
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "seed": 2**64},
        400,
        "seed",
        "invalid_value",
    ),
    (
        "POST",
        "/generate",
        {"text": "a", "sampling_params": {"seed": -(2**63) - 1}},
        400,
        "sampling_params.seed",
        "invalid_value",
    ),
    ("POST", "/detokenize", {"tokens": [500]}, 400, "tokens", None),
    ("GET", "/v1/nowhere", None, 404, None, None),
    ("GET", "/v1/completions", None, 405, None, None),
]


@pytest.mark.parametrize(("method", "path", "body", "status", "param", "code"), BAD_REQUESTS)
async def test_bad_requests_get_openai_errors_and_the_server_carries_on(
    client: QuartClient,
    engine: FakeEngine,
    method: str,
    path: str,
    body: Any,
    status: int,
    param: str | None,
    code: str | None,
) -> None:
    if isinstance(body, bytes):
        response = await client.open(
            path, method=method, data=body, headers={"Content-Type": "application/json"}
        )
    else:
        response = await client.open(path, method=method, json=body)
    assert response.status_code == status
    error = (await response.get_json())["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["param"] == param and error["code"] == code
    assert not engine.requests  # nothing was queued
    ok = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert ok.status_code == 200


async def test_api_key(engine: FakeEngine) -> None:
    app = create_app(engine, ServerSettings(served_model_name=MODEL, api_key="sesame"))
    async with app.test_app() as test_app:
        client = test_app.test_client()
        body = {"model": MODEL, "prompt": "hi"}
        missing = await client.post("/v1/completions", json=body)
        wrong = await client.post(
            "/v1/completions", json=body, headers={"Authorization": "Bearer nope"}
        )
        right = await client.post(
            "/v1/completions", json=body, headers={"Authorization": "Bearer sesame"}
        )
        lower = await client.post(
            "/v1/completions", json=body, headers={"Authorization": "bearer sesame"}
        )
        no_scheme = await client.post(
            "/v1/completions", json=body, headers={"Authorization": "sesame"}
        )
        assert (missing.status_code, wrong.status_code, right.status_code) == (401, 401, 200)
        assert (lower.status_code, no_scheme.status_code) == (200, 401)  # the scheme: any case
        assert (await missing.get_json())["error"]["code"] == "invalid_api_key"
        assert missing.headers["WWW-Authenticate"] == "Bearer"
        assert (await client.get("/health")).status_code == 200  # probes need no key
        assert (await client.get("/openapi.json")).status_code == 200  # nor the schema


async def test_overload_is_503_and_counts_sequences(engine: FakeEngine) -> None:
    app = create_app(engine, ServerSettings(served_model_name=MODEL, max_open_requests=4))
    async with app.test_app() as test_app:
        client = test_app.test_client()
        engine.open.update({"a", "b"})
        three = {"model": MODEL, "prompt": ["x", "y", "z"]}
        full = await client.post("/v1/completions", json=three)  # 2 open + 3 > 4
        assert full.status_code == 503 and full.headers["Retry-After"] == "1"
        assert (await full.get_json())["error"]["code"] == "overloaded"
        never = await client.post("/v1/completions", json={"model": MODEL, "prompt": ["x"] * 5})
        assert never.status_code == 400  # more than it could ever run at once: no retry
        assert (await never.get_json())["error"]["code"] == "too_many_prompts"
        engine.open.clear()
        assert (await client.post("/v1/completions", json=three)).status_code == 200


async def test_an_unsupported_content_part_names_its_type_and_path(client: QuartClient) -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}]
    body = {"model": MODEL, "messages": [{"role": "user", "content": parts}]}
    error = (await (await client.post("/v1/chat/completions", json=body)).get_json())["error"]
    assert error["param"] == "messages[0].content[1].type"
    assert error["message"].startswith("messages[0].content[1].type: 'image_url' is not supported")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b'{"model": "fake-model", "prompt": "x", "seed": ' + b"9" * 5000 + b"}", "4300 digits"),
        (b'{"model": "fake-model", "prompt": "\\ud800"}', "not valid Unicode"),
    ],
)
async def test_pathological_json_is_a_400(client: QuartClient, body: bytes, message: str) -> None:
    response = await client.post(
        "/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 400
    assert message in (await response.get_json())["error"]["message"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("stop", ["s"] * 65),
        ("stop", "s" * 1025),
        ("stop_token_ids", [1] * 1025),
        ("prompt", ["p"] * 129),
    ],
)
async def test_lists_a_client_controls_are_capped(
    client: QuartClient, field: str, value: object
) -> None:
    body = {"model": MODEL, "prompt": "x", field: value}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 400
    assert (await response.get_json())["error"]["param"] == field


async def test_engine_failure_mid_stream_is_reported_in_band(engine: FakeEngine) -> None:
    async def broken(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        raise RuntimeError("the engine died")
        yield  # pragma: no cover

    engine._run = broken  # type: ignore[method-assign]
    app = create_app(engine, ServerSettings(served_model_name=MODEL))
    async with app.test_app() as test_app:
        response = await test_app.test_client().post(
            "/v1/completions", json={"model": MODEL, "prompt": "hi", "stream": True}
        )
        chunks = sse_payloads(await response.get_data())
        assert chunks[-1]["error"]["message"] == "the engine died"


def test_text_chunk_templates_match_the_general_encoder() -> None:
    from api.http.streaming import TextChunks, sse_event

    head = {"id": "cmpl-1", "object": "text_completion", "created": 5, "model": "m"}
    chunks = TextChunks(
        head, ',"text":', ',"logprobs":null,"finish_reason":null,"stop_reason":null'
    )
    for text in ["plain", 'quote " and \\ slash', "ünïcødé ✓\n\t", ""]:
        choice = {
            "index": 2,
            "text": text,
            "logprobs": None,
            "finish_reason": None,
            "stop_reason": None,
        }
        assert chunks.event(2, text) == sse_event(head | {"choices": [choice]})


async def test_a_request_past_the_request_timeout_is_a_408(
    engine: FakeEngine, autojump_clock: trio.testing.MockClock
) -> None:
    engine.step = trio.Event()  # never set: the engine never produces a token
    settings = ServerSettings(served_model_name=MODEL, request_timeout=10)
    app = create_app(engine, settings)
    async with app.test_app() as test_app:
        client = test_app.test_client()
        whole = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
        assert whole.status_code == 408
        assert (await whole.get_json())["error"]["code"] == "request_timeout"
        body = {"model": MODEL, "prompt": "hi", "stream": True}
        streamed = await client.post("/v1/completions", json=body)
        chunks = sse_payloads(await streamed.get_data())
        assert chunks[-1]["error"]["code"] == "request_timeout"
    assert not engine.open  # the requests ended
