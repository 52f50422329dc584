"""Tool calling over HTTP against the fake engine, which writes a scripted reply: the request
fields and their 400s, the constraint each tool_choice asks for, the answer's tool_calls and
finish reason, and streamed deltas that add up to the whole answer. The real model's end to
end runs are in tests/test_tool_calling.py."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from quart.typing import TestClientProtocol as QuartClient

from api.app import create_app
from api.http.state import ServerSettings
from tests.api_helpers import MODEL, post_streamed, sse_payloads
from tests.fake_engine import FakeEngine

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}
USER = [{"role": "user", "content": "weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SECOND = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'


@pytest.fixture
async def tool_client(engine: FakeEngine) -> AsyncIterator[QuartClient]:
    settings = ServerSettings(
        served_model_name=MODEL, tool_call_parser="hermes", enable_auto_tool_choice=True
    )
    app = create_app(engine, settings)
    async with app.test_app() as test_app:
        yield test_app.test_client()


async def chat(client: QuartClient, **fields: Any) -> tuple[int, dict[str, Any]]:
    body = {"model": MODEL, "messages": USER, "tools": [WEATHER, NOW]} | fields
    response = await client.post("/v1/chat/completions", json=body)
    return response.status_code, await response.get_json()


async def streamed(client: QuartClient, **fields: Any) -> list[dict[str, Any]]:
    body = {"model": MODEL, "messages": USER, "tools": [WEATHER, NOW], "stream": True} | fields
    return sse_payloads(await post_streamed(client, "/v1/chat/completions", body))


def accumulate(chunks: list[dict[str, Any]]) -> tuple[str | None, list[dict[str, Any]], str]:
    """The content, calls and finish reason, accumulated as openai-python does: string
    fields concatenated, calls keyed by index."""
    content: str | None = None
    calls: dict[int, dict[str, Any]] = {}
    finish = ""
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            if delta.get("content"):
                content = (content or "") + delta["content"]
            for piece in delta.get("tool_calls") or []:
                call = calls.setdefault(piece["index"], {"function": {"arguments": ""}})
                if "id" in piece:
                    assert "id" not in call, "an id is sent once"
                    call["id"], call["type"] = piece["id"], piece["type"]
                    call["function"]["name"] = piece["function"]["name"]
                call["function"]["arguments"] += piece["function"]["arguments"]
            finish = choice["finish_reason"] or finish
    return content, [calls[i] for i in sorted(calls)], finish


async def test_auto_reads_calls_and_content(tool_client: QuartClient, engine: FakeEngine) -> None:
    engine.reply = "Let me look.\n" + CALL + "\n" + SECOND
    status, body = await chat(tool_client)
    assert status == 200, body
    (choice,) = body["choices"]
    message = choice["message"]
    assert message["content"] == "Let me look.\n"
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather", "now"]
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert message["tool_calls"][1]["function"]["arguments"] == "{}"
    ids = [c["id"] for c in message["tool_calls"]]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)
    assert choice["finish_reason"] == "tool_calls"
    assert engine.last_tools == [WEATHER, NOW]
    _, params, _ = engine.requests[-1]
    assert params.constraint is None  # auto without strict tools is not constrained

    content, calls, finish = accumulate(await streamed(tool_client))
    assert content == message["content"] and finish == "tool_calls"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]
    ]


async def test_required_and_named_are_constrained(
    tool_client: QuartClient, engine: FakeEngine
) -> None:
    engine.reply = CALL
    status, body = await chat(tool_client, tool_choice="required")
    assert status == 200 and body["choices"][0]["finish_reason"] == "tool_calls"
    _, params, _ = engine.requests[-1]
    assert params.constraint.kind == "grammar" and "get_weather" in params.constraint.source
    assert "now" in params.constraint.source
    named = {"type": "function", "function": {"name": "get_weather"}}
    status, body = await chat(tool_client, tool_choice=named)
    assert status == 200, body
    _, params, _ = engine.requests[-1]
    assert '"now"' not in params.constraint.source  # only the named one
    assert body["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


async def test_strict_tools_constrain_auto(tool_client: QuartClient, engine: FakeEngine) -> None:
    strict = {"type": "function", "function": WEATHER["function"] | {"strict": True}}
    engine.reply = "no call"
    status, body = await chat(tool_client, tools=[strict, NOW])
    assert status == 200 and body["choices"][0]["message"]["content"] == "no call"
    _, params, _ = engine.requests[-1]
    assert params.constraint.kind == "grammar" and "TEXT" in params.constraint.source


async def test_none_returns_text_even_if_it_looks_like_a_call(
    tool_client: QuartClient, engine: FakeEngine
) -> None:
    engine.reply = CALL
    _status, body = await chat(tool_client, tool_choice="none")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": CALL}
    assert body["choices"][0]["finish_reason"] == "stop"
    content, calls, _ = accumulate(await streamed(tool_client, tool_choice="none"))
    assert content == CALL and calls == []


async def test_a_broken_call_is_content(tool_client: QuartClient, engine: FakeEngine) -> None:
    for reply in ("<tool_call>\n{not json}\n</tool_call>", CALL.replace("get_weather", "nope")):
        engine.reply = reply
        status, body = await chat(tool_client)
        assert status == 200
        assert body["choices"][0]["message"] == {"role": "assistant", "content": reply}
        assert body["choices"][0]["finish_reason"] == "stop"
        content, calls, finish = accumulate(await streamed(tool_client))
        assert (content, calls, finish) == (reply, [], "stop")


async def test_a_call_cut_by_max_tokens_ends_with_length(
    tool_client: QuartClient, engine: FakeEngine
) -> None:
    engine.reply = CALL
    status, body = await chat(tool_client, max_tokens=12)  # 36 characters of the call
    assert status == 200
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length"
    _content, calls, finish = accumulate(await streamed(tool_client, max_tokens=12))
    assert finish == "length"
    message_calls = choice["message"].get("tool_calls") or []
    assert [c["function"]["arguments"] for c in calls] == [
        c["function"]["arguments"] for c in message_calls
    ]


async def test_without_parallel_calls_the_first_is_read(
    tool_client: QuartClient, engine: FakeEngine
) -> None:
    engine.reply = CALL + "\n" + SECOND
    _status, body = await chat(tool_client, parallel_tool_calls=False)
    calls = body["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    _, calls, _ = accumulate(await streamed(tool_client, parallel_tool_calls=False))
    assert [c["function"]["name"] for c in calls] == ["get_weather"]


async def test_history_with_calls_and_results(tool_client: QuartClient, engine: FakeEngine) -> None:
    history = [*USER,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]  # fmt: skip
    engine.reply = "It is sunny."
    status, body = await chat(tool_client, messages=history)
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == "It is sunny."
    response = await tool_client.post("/tokenize", json={"messages": history, "tools": [WEATHER]})
    assert response.status_code == 200
    tokens = (await response.get_json())["tokens"]
    rendered = "<user>weather in Paris?<assistant><tool>sunny, 21 C<assistant>"
    assert tokens == await engine.tokenize(rendered) and engine.last_tools == [WEATHER]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
        ({"tools": [], "tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"messages": [*USER, {"role": "tool", "tool_call_id": "x", "content": "1"}]},
         "messages[1].tool_call_id"),
        ({"messages": [*USER, {"role": "tool", "content": "1"}]}, "tool_call_id"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
          "function": {"name": "f", "arguments": "{oops"}}]}]}, "arguments"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"id": "c",
          "function": {"name": "f", "arguments": "{}"}}]}]}, "tool_calls"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)  # fmt: skip
async def test_bad_tool_fields_are_400s(
    tool_client: QuartClient, engine: FakeEngine, fields: dict[str, Any], param: str
) -> None:
    status, body = await chat(tool_client, **fields)
    assert status == 400, body
    assert param in (body["error"]["param"] or "") + body["error"]["message"], body
    assert not engine.requests


async def test_auto_needs_the_flags(client: QuartClient, engine: FakeEngine) -> None:
    status, body = await chat(client)  # tools, and auto by default
    assert status == 400
    message = body["error"]["message"]
    assert "--enable-auto-tool-choice" in message and "--tool-call-parser" in message
    engine.reply = CALL  # required works without them, in the hermes format
    status, body = await chat(client, tool_choice="required")
    assert status == 200 and body["choices"][0]["finish_reason"] == "tool_calls"
    status, body = await chat(client, tool_choice="none")
    assert status == 200


@pytest.mark.parametrize("choice", ["required", "auto"])
async def test_parameters_nested_too_deeply_are_a_400(
    tool_client: QuartClient, choice: str
) -> None:
    """A schema nested hundreds of levels deep (the JSON parser allows ~1000) is refused
    before anything walks it recursively: it was a 500 (RecursionError)."""
    parameters: dict[str, Any] = {}
    for _ in range(450):
        parameters = {"type": "object", "properties": {"a": parameters}}
    tool = {"type": "function", "function": {"name": "f", "strict": True, "parameters": parameters}}
    status, body = await chat(tool_client, tools=[tool], tool_choice=choice)
    assert status == 400, body
    assert "nested deeper" in body["error"]["message"]
    assert body["error"]["param"] == "tools[0].function.parameters"
    status, _ = await chat(tool_client)  # and it goes on serving
    assert status == 200
