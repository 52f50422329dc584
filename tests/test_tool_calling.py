"""Tool calling end to end: the default model (SmolLM2, under the built-in Hermes-style tools
template) behind `runtime serve --enable-auto-tool-choice --tool-call-parser hermes`, asked
through the official openai client, streamed answers accumulated by the client's own stream
helper."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import pytest
from openai import OpenAI

from tests.server_process import ServerProcess

MODEL_ID = "smollm2-135m-instruct"
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 40},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the web",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "maxLength": 60},
            "max_results": {"type": "integer", "minimum": 1, "maximum": 10}},
            "required": ["query"]}}},
]  # fmt: skip
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def oai(smollm2_server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=smollm2_server.url + "/v1", api_key="unused", max_retries=0)


def ask(oai: OpenAI, **fields: Any) -> Any:
    fields = {"messages": WEATHER, "tools": TOOLS, "temperature": 0, "max_tokens": 80} | fields
    return oai.chat.completions.create(model=MODEL_ID, **fields)


def streamed(oai: OpenAI, **fields: Any) -> Any:
    """The streamed answer as the client's own stream helper accumulates the deltas (its
    snapshot: the final completion would refuse an answer cut by max_tokens)."""
    fields = {"messages": WEATHER, "tools": TOOLS, "temperature": 0, "max_tokens": 80} | fields
    with oai.chat.completions.stream(model=MODEL_ID, **fields) as stream:
        stream.until_done()
        return stream.current_completion_snapshot


def calls_of(message: Any) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def assert_valid(calls: list[tuple[str, str]]) -> None:
    assert calls
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), PARAMETERS[name])


def test_a_named_tool_is_called_with_valid_arguments(oai: OpenAI) -> None:
    named = {"type": "function", "function": {"name": "add"}}
    reply = ask(oai, tool_choice=named, messages=[{"role": "user", "content": "2 plus 3?"}])
    (choice,) = reply.choices
    assert choice.finish_reason == "tool_calls"
    calls = calls_of(choice.message)
    assert [name for name, _ in calls] == ["add"]
    assert_valid(calls)
    assert choice.message.tool_calls[0].id.startswith("call_")


def test_required_calls_tools_and_streams_the_same(oai: OpenAI) -> None:
    reply = ask(oai, tool_choice="required", max_tokens=120)
    (choice,) = reply.choices
    calls = calls_of(choice.message)
    assert_valid(calls)
    assert choice.finish_reason == "tool_calls"
    ids = [c.id for c in choice.message.tool_calls]
    assert len(set(ids)) == len(ids)
    final = streamed(oai, tool_choice="required", max_tokens=120)
    assert calls_of(final.choices[0].message) == calls
    assert final.choices[0].finish_reason == "tool_calls"


def test_none_never_calls_even_when_the_text_looks_like_a_call(oai: OpenAI) -> None:
    looks_like_a_call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    pattern = looks_like_a_call.replace("{", r"\{").replace("}", r"\}")
    reply = ask(oai, tool_choice="none", extra_body={"structured_outputs": {"regex": pattern}})
    (choice,) = reply.choices
    assert choice.message.content == looks_like_a_call
    assert not choice.message.tool_calls and choice.finish_reason == "stop"


def test_auto_answers_whole_and_streamed_alike(oai: OpenAI) -> None:
    """Under auto the model chooses (this small one mostly answers in words); either way
    the streamed answer is the whole one."""
    for messages in (WEATHER, [{"role": "user", "content": "Search the web for trio."}]):
        reply = ask(oai, messages=messages)
        message = reply.choices[0].message
        final = streamed(oai, messages=messages)
        assert final.choices[0].message.content == message.content
        assert calls_of(final.choices[0].message) == calls_of(message)
        assert final.choices[0].finish_reason == reply.choices[0].finish_reason


def test_a_tool_result_renders_and_is_answered(oai: OpenAI, smollm2_server: ServerProcess) -> None:
    history = [*WEATHER,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 degrees"},
    ]  # fmt: skip
    rendered = httpx.post(
        smollm2_server.url + "/tokenize", json={"messages": history, "tools": TOOLS}
    ).json()["tokens"]
    text = httpx.post(smollm2_server.url + "/detokenize", json={"tokens": rendered}).json()
    assert "<tool_response>\nsunny, 21 degrees\n</tool_response>" in text["prompt"]
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text["prompt"]
    assert '"name": "search"' in text["prompt"]  # the tools, in the system turn
    reply = ask(oai, messages=history, tool_choice="none", max_tokens=40)
    assert reply.choices[0].message.content
    assert reply.usage.prompt_tokens == len(rendered)
