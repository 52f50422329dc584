"""The HTTP layer against a fake engine: shapes, streaming, and every error path."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio
from quart.typing import TestClientProtocol as QuartClient

from api.app import create_app
from api.state import ServerSettings
from tests.fake_engine import FakeEngine

MODEL = "fake-model"


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
async def client(engine: FakeEngine) -> AsyncIterator[QuartClient]:
    app = create_app(engine, ServerSettings(served_model_name=MODEL))
    async with app.test_app() as test_app:
        yield test_app.test_client()


def sse_payloads(body: bytes) -> list[Any]:
    events = [e for e in body.decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), events
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[len("data: ") :]) for e in events[:-1]]


async def test_completion(client: QuartClient, engine: FakeEngine) -> None:
    response = await client.post(
        "/v1/completions",
        json={
            "model": MODEL,
            "prompt": "hi",
            "max_tokens": 3,
            "temperature": 0,
            "seed": 5,
            "stop_token_ids": [7],
            "top_k": 3,
            "min_p": 0.1,
            "user": "u",
        },
    )
    body = await response.get_json()
    assert response.status_code == 200
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert body["choices"] == [
        {
            "index": 0,
            "text": "alpha beta gamma ",
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
        }
    ]
    assert body["usage"]["prompt_tokens"] == 2 and body["usage"]["completion_tokens"] == 3
    _, params, _ = engine.requests[0]
    assert (params.max_tokens, params.temperature, params.seed, params.top_k) == (3, 0.0, 5, 3)
    assert params.stop_token_ids == (7,) and params.min_p == 0.1


async def test_several_prompts_make_several_choices(client: QuartClient) -> None:
    response = await client.post(
        "/v1/completions", json={"model": MODEL, "prompt": ["a", [1, 2, 3]], "max_tokens": 2}
    )
    body = await response.get_json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["prompt_tokens"] == 4 and body["usage"]["completion_tokens"] == 4


async def test_streamed_completion_with_usage(client: QuartClient) -> None:
    response = await client.post(
        "/v1/completions",
        json={
            "model": MODEL,
            "prompt": "hi",
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert response.headers["Content-Type"] == "text/event-stream"
    chunks = sse_payloads(await response.get_data())
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == "alpha beta gamma "
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, None, "length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


async def test_streamed_multi_prompt_completion(client: QuartClient) -> None:
    response = await client.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": ["a", "b"], "max_tokens": 2, "stream": True},
    )
    chunks = sse_payloads(await response.get_data())
    by_index: dict[int, str] = {0: "", 1: ""}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        by_index[choice["index"]] += choice["text"]
    assert by_index == {0: "alpha beta ", 1: "alpha beta "}


async def test_chat_and_streamed_chat(client: QuartClient, engine: FakeEngine) -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "name": "ann", "content": [{"type": "text", "text": "hello"}]},
    ]
    response = await client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "max_completion_tokens": 2},
    )
    body = await response.get_json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "alpha beta "}
    prompt, _, _ = engine.requests[0]
    assert prompt == engine.tokenize("<system>be brief<user:ann>hello<assistant>")
    response = await client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "max_tokens": 2, "stream": True},
    )
    chunks = sse_payloads(await response.get_data())
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    contents = [c["choices"][0]["delta"].get("content") for c in chunks[1:-1]]
    assert contents == ["alpha ", "beta "]
    assert chunks[-1]["choices"][0]["delta"] == {}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


async def test_stop_string_is_reported(client: QuartClient) -> None:
    response = await client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 5, "stop": "mma"}
    )
    (choice,) = (await response.get_json())["choices"]
    assert choice["text"] == "alpha beta ga" and choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == "mma"


async def test_native_generate(client: QuartClient) -> None:
    response = await client.post(
        "/generate",
        json={
            "text": "hello",
            "sampling_params": {"max_new_tokens": 2, "temperature": 0},
            "rid": "abc",
        },
    )
    body = await response.get_json()
    assert body["text"] == "alpha beta " and body["output_ids"] == [0, 1]
    assert body["meta_info"] == {
        "id": "abc",
        "finish_reason": {"type": "length", "length": 2},
        "prompt_tokens": 5,
        "completion_tokens": 2,
        "cached_tokens": 0,
    }
    response = await client.post(
        "/generate",
        json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3}, "stream": True},
    )
    chunks = sse_payloads(await response.get_data())
    assert [c["text"] for c in chunks] == ["alpha ", "alpha beta ", "alpha beta gamma "]
    assert chunks[-1]["output_ids"] == [0, 1, 2]


async def test_models_tokenize_detokenize(client: QuartClient) -> None:
    models = await (await client.get("/v1/models")).get_json()
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == 64
    tokens = await (await client.post("/tokenize", json={"prompt": "ab"})).get_json()
    assert tokens == {"count": 2, "max_model_len": 64, "tokens": [97, 98]}
    chat = await (
        await client.post("/tokenize", json={"messages": [{"role": "user", "content": "a"}]})
    ).get_json()
    assert chat["count"] == len("<user>a<assistant>")
    text = await (await client.post("/detokenize", json={"tokens": [33, 34]})).get_json()
    assert text == {"prompt": "AB"}


async def test_health(engine: FakeEngine, autojump_clock: trio.testing.MockClock) -> None:
    app = create_app(engine, ServerSettings(served_model_name=MODEL, health_timeout=5))
    async with app.test_app() as test_app:
        client = test_app.test_client()
        assert (await client.get("/health")).status_code == 200
        engine.healthy = False
        response = await client.get("/health")
        assert response.status_code == 503
        assert (await response.get_json())["error"]["code"] == "unhealthy"


async def test_metrics(client: QuartClient) -> None:
    await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
    text = (await (await client.get("/metrics")).get_data()).decode()
    for line in [
        "runtime:num_requests_running 0.0",
        "runtime:num_requests_waiting 0.0",
        "runtime:kv_cache_usage_perc 0.1",
        "runtime:prompt_tokens_total 7.0",
        "runtime:generation_tokens_total 11.0",
        "runtime:time_to_first_token_seconds_count 1.0",
        "runtime:inter_token_latency_seconds_count 2.0",
        "runtime:e2e_request_latency_seconds_count 1.0",
    ]:
        assert line in text, line


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
        "prompt",
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
        "stop",
        "invalid_value",
    ),
    (
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "n": 2},
        400,
        "n",
        "unsupported_parameter",
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
        {"model": MODEL, "prompt": "hi", "logprobs": 2},
        400,
        "logprobs",
        "unsupported_parameter",
    ),
    (
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "presence_penalty": 0.5},
        400,
        "presence_penalty",
        "unsupported_parameter",
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
        {"model": MODEL, "prompt": "hi", "frobnicate": 1},
        400,
        "frobnicate",
        "unknown_parameter",
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
        "messages.0.role",
        "invalid_value",
    ),
    (
        "POST",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True},
        400,
        "logprobs",
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
        "tools",
        "unsupported_parameter",
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
        assert (missing.status_code, wrong.status_code, right.status_code) == (401, 401, 200)
        assert (await missing.get_json())["error"]["code"] == "invalid_api_key"
        assert (await client.get("/health")).status_code == 200  # probes need no key


async def test_overload_is_503(engine: FakeEngine) -> None:
    app = create_app(engine, ServerSettings(served_model_name=MODEL, max_open_requests=2))
    engine.open.update({"a", "b"})
    async with app.test_app() as test_app:
        response = await test_app.test_client().post(
            "/v1/completions", json={"model": MODEL, "prompt": "hi"}
        )
        assert response.status_code == 503
        assert (await response.get_json())["error"]["code"] == "overloaded"


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
    from api.streaming import TextChunks, sse_event

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
