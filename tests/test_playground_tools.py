"""The playground's JSON-schema and tools boxes in Debian's chromium (tests/playground_page.py),
against the session's shared tiny server (float32, no key, no tool-call parser): what the boxes
send, what blocks sending, tool calls drawn as text, and their results sent back as a history
the server takes. Replies with tool calls come from the test (a model of random weights makes
none of its own)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.playground_page import (
    Tab,
    chat_stream,
    chromium,
    last_reply,
    models_listed,
    open_tab,
    send,
    serve_stream,
    set_field,
)
from tests.server_process import ServerProcess

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]
YES_NO = {"enum": ["yes", "no"]}
NASTY = "<img src=x onerror=window.pwned=1>"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    yield from chromium()


@pytest.fixture
def tab(browser: Any, control_server: ServerProcess) -> Iterator[Tab]:
    opened = open_tab(browser, control_server.url, key=None)
    models_listed(opened.page)
    yield opened
    opened.page.context.close()


def calls_stream(calls: list[tuple[str, str]]) -> str:
    """Tool calls as the server streams them: per call its index, id, type and name once, then
    its arguments in two fragments; finish_reason tool_calls."""
    choices: list[dict[str, Any]] = []
    for i, (name, arguments) in enumerate(calls):
        start = {"index": i, "id": f"call_{i}", "type": "function"}
        choices.append({"delta": {"tool_calls": [start | {"function": {"name": name}}]}})
        for piece in (arguments[:5], arguments[5:]):
            fragment = {"index": i, "function": {"arguments": piece}}
            choices.append({"delta": {"tool_calls": [fragment]}})
    return chat_stream([*choices, {"delta": {}, "finish_reason": "tool_calls"}])


def test_schema_and_tools_reach_the_request_body(tab: Tab) -> None:
    page = tab.page
    set_field(page, "[data-setting=max_tokens]", "32")
    set_field(page, "#tools", json.dumps(WEATHER))
    send(page, "Weather?")  # tool_choice auto, which this server (no parser) answers with a 400
    error = last_reply(page).locator(".stats.error").inner_text()
    assert error.startswith("The server answered 400: ") and "--enable-auto-tool-choice" in error
    page.select_option("#tool-choice", "none")
    set_field(page, "#schema", json.dumps(YES_NO))
    page.reload()  # the boxes are settings like the others
    models_listed(page)
    assert json.loads(page.input_value("#tools")) == WEATHER
    assert json.loads(page.input_value("#schema")) == YES_NO
    assert page.input_value("#tool-choice") == "none"
    send(page, "Yes or no?")
    assert json.loads(last_reply(page).locator(".body").inner_text()) in ("yes", "no")
    body = tab.bodies[-1][1]
    schema = {"name": "playground", "schema": YES_NO, "strict": True}
    assert body["response_format"] == {"type": "json_schema", "json_schema": schema}
    assert body["tools"] == WEATHER and body["tool_choice"] == "none"
    assert body["messages"] == [{"role": "user", "content": t} for t in ("Weather?", "Yes or no?")]
    assert tab.errors and all("400" in error for error in tab.errors)  # the browser's own line


def test_a_box_that_does_not_parse_blocks_sending(tab: Tab) -> None:
    page = tab.page
    set_field(page, "#schema", '{"type": "object",')
    assert page.inner_text("#schema-error").startswith("Not JSON")
    page.fill("#input", "Hello")
    page.press("#input", "Enter")
    assert page.inner_text("#notice").startswith("Not sent: the JSON-schema box under Settings")
    assert page.input_value("#input") == "Hello" and page.locator(".msg").count() == 0
    set_field(page, "#schema", "")
    set_field(page, "#tools", json.dumps(WEATHER[0]))  # one tool, not a list of them
    assert page.is_hidden("#schema-error") and "array" in page.inner_text("#tools-error")
    page.click("#send")
    assert page.inner_text("#notice").startswith("Not sent: the tools box under Settings")
    assert tab.bodies == [] and tab.errors == []


def test_tool_calls_are_shown_as_text_and_run_nothing(tab: Tab) -> None:
    page = tab.page
    calls = [(NASTY, '{"a": 1}'), ("get_weather", json.dumps({"city": NASTY}))]
    serve_stream(page, calls_stream(calls))
    set_field(page, "#tools", json.dumps(WEATHER))
    send(page, "Call something nasty.")
    reply = last_reply(page)
    assert reply.locator(".call").all_inner_texts() == [f"{n}({a})" for n, a in calls]
    assert reply.locator(".stats").inner_text().endswith(" · tool_calls")
    assert reply.locator(".results input").count() == 2
    assert page.locator("#messages img").count() == 0
    assert page.evaluate("() => window.pwned") is None
    assert tab.errors == []


def test_tool_results_go_back_as_tool_messages(tab: Tab) -> None:
    """The first reply's calls come from the test; the results typed under them, and the
    history holding both, go to the real server, which takes them."""
    page = tab.page
    set_field(page, "[data-setting=max_tokens]", "4")
    set_field(page, "#tools", json.dumps(WEATHER))
    page.select_option("#tool-choice", "none")  # this server has no parser for "auto"
    arguments = [json.dumps({"city": city}) for city in ("Paris", "Oslo")]
    serve_stream(page, calls_stream([("get_weather", a) for a in arguments]), times=1)
    send(page, "Weather in Paris and Oslo?")
    page.fill(".results input >> nth=0", "18 C")
    page.fill(".results input >> nth=1", "3 C")
    page.click(".results button")
    page.wait_for_function(
        "() => document.querySelectorAll('.msg.assistant').length === 2"
        " && !document.querySelector('.msg.streaming')"
    )
    assert last_reply(page).locator(".stats.error").count() == 0
    function = {"name": "get_weather"}
    calls = [
        {"id": f"call_{i}", "type": "function", "function": function | {"arguments": a}}
        for i, a in enumerate(arguments)
    ]
    assert tab.bodies[-1][1]["messages"][1:] == [
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_0", "content": "18 C"},
        {"role": "tool", "tool_call_id": "call_1", "content": "3 C"},
    ]
    page.reload()  # the calls and their results are kept with the conversation
    models_listed(page)
    assert page.locator(".call").count() == 2 and page.locator(".msg.tool").count() == 2
    send(page, "Thanks.")
    assert last_reply(page).locator(".stats.error").count() == 0
    assert tab.bodies[-1][1]["messages"][1]["tool_calls"] == calls and tab.errors == []


def test_calls_left_unanswered_or_cut_short_are_not_sent_back(tab: Tab) -> None:
    """tools.js's history: a call goes back only with the tool message that answers it."""
    page = tab.page
    sent = page.evaluate(SENT_MESSAGES)
    assert sent == [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "thinking", "tool_calls": [ANSWERED]},
        {"role": "tool", "tool_call_id": "c2", "content": "42"},
    ]
    assert tab.errors == []


ANSWERED = {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "{}"}}
# an unanswered call, a call cut short by Stop (its arguments not yet JSON), an answered one
SENT_MESSAGES = """async () => {
  const { sentMessages } = await import("./playground/tools.js");
  const call = (id, args) => ({ id, type: "function", function: { name: "f", arguments: args } });
  return sentMessages([
    { role: "user", content: "a" },
    { role: "assistant", content: "", tool_calls: [call("c1", "{}")] },
    { role: "user", content: "b" },
    { role: "assistant", content: "thinking", tool_calls: [call("c2", "{}"), call("c3", '{"x":')] },
    { role: "tool", tool_call_id: "c2", name: "f", content: "42" },
  ]);
}"""
