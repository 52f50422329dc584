"""The HTTP layer against a fake engine: response shapes and streaming."""

from __future__ import annotations

import trio
from quart.typing import TestClientProtocol as QuartClient

from api.app import create_app
from api.http.state import ServerSettings
from tests.api_helpers import MODEL, sse_payloads
from tests.fake_engine import FakeEngine


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
    assert prompt == await engine.tokenize("<system>be brief<user:ann>hello<assistant>")
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
        "weight_version": "default",
    }
    response = await client.post(
        "/generate",
        json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3}, "stream": True},
    )
    chunks = sse_payloads(await response.get_data())  # only what is new in each
    assert [c["text"] for c in chunks] == ["alpha ", "beta ", "gamma "]
    assert [c["output_ids"] for c in chunks] == [[0], [1], [2]]
    assert [c["meta_info"]["completion_tokens"] for c in chunks] == [1, 2, 3]


async def test_native_generate_streams_cumulatively_if_asked(engine: FakeEngine) -> None:
    settings = ServerSettings(served_model_name=MODEL, cumulative_streaming_output=True)
    async with create_app(engine, settings).test_app() as app:
        response = await app.test_client().post(
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
        error = (await response.get_json())["error"]
        assert error["code"] == "unhealthy" and "the worker is not answering" in error["message"]


async def test_metrics(client: QuartClient) -> None:
    await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
    text = (await (await client.get("/metrics")).get_data()).decode()
    for line in [
        'runtime:num_requests_running{dp_rank="0"} 0.0',
        'runtime:num_requests_waiting{dp_rank="0"} 0.0',
        'runtime:kv_cache_usage_perc{dp_rank="0"} 0.1',
        'runtime:prompt_tokens_total{dp_rank="0"} 7.0',
        'runtime:generation_tokens_total{dp_rank="0"} 11.0',
        "runtime:time_to_first_token_seconds_count 1.0",
        "runtime:inter_token_latency_seconds_count 2.0",
        "runtime:e2e_request_latency_seconds_count 1.0",
    ]:
        assert line in text, line


async def test_metrics_have_one_sample_per_data_parallel_group() -> None:
    engine = FakeEngine(data_parallel_size=2)
    app = create_app(engine, ServerSettings(served_model_name=MODEL))
    async with app.test_app() as test_app:
        text = await (await test_app.test_client().get("/metrics")).get_data(as_text=True)
    for rank in ("0", "1"):
        assert f'runtime:generation_tokens_total{{dp_rank="{rank}"}} 11.0' in text
        assert f'vllm:num_requests_running{{engine="{rank}",model_name="{MODEL}"}} 0.0' in text
        assert f'engine="{rank}",num_gpu_blocks="100"' in text


async def test_openapi_describes_every_route_with_its_real_schema(client: QuartClient) -> None:
    response = await client.get("/openapi.json")
    document = await response.get_json()
    assert response.status_code == 200 and document["openapi"].startswith("3.1")
    schemas = document["components"]["schemas"]
    for path in ("/v1/completions", "/v1/chat/completions", "/generate", "/tokenize"):
        body = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        name = body["schema"]["$ref"].rsplit("/", 1)[1]
        assert schemas[name]["additionalProperties"] is True  # ignored, and named (fields.py)
    assert set(schemas["CompletionRequest"]["required"]) == {"model", "prompt"}
    assert schemas["ChatMessage"]["properties"]["role"]["enum"]  # nested models resolve
    for path in ("/v1/models", "/health", "/metrics"):
        assert "get" in document["paths"][path]
