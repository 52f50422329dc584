"""Tool-call parsers and their stream deltas, as pure functions of the text (api/tools/):
several calls, empty and nested arguments, text before a call, a call cut short, and any
text at all never raising; streamed deltas always add up to the whole answer."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from api.tools.parsers import PARSERS, hermes, llama3_json, parameter_types, qwen3_xml
from api.tools.stream import ToolCallReader, ToolCallStream, read_calls

NAMES = frozenset({"get_weather", "add", "now"})
ADD_PARAMETERS = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "number"}, "note": {"type": "string"}},
}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": ADD_PARAMETERS}}]
TYPES = parameter_types(TOOLS)


def hermes_call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def test_hermes_reads_several_calls_with_text_before_them() -> None:
    nested = '{"city": "Paris", "when": {"day": [1, 2], "tz": null}}'
    text = "Let me check.\n" + hermes_call("get_weather", nested) + "\n" + hermes_call("now", "{}")
    parsed = hermes(text, True, {})
    assert parsed.content == "Let me check.\n" and not parsed.broken
    assert [(c.name, c.arguments, c.complete) for c in parsed.calls] == [
        ("get_weather", nested, True),
        ("now", "{}", True),
    ]


def test_a_call_without_arguments_has_an_empty_object() -> None:
    (call,) = hermes('<tool_call>{"name": "now"}</tool_call>', True, {}).calls
    assert (call.name, call.arguments, call.complete) == ("now", "{}", True)


def test_a_call_cut_short_is_open_and_its_arguments_a_prefix() -> None:
    text = hermes_call("add", '{"a": 1, "b": 2.5}')
    for cut in range(len(text)):
        parsed = hermes(text[:cut], False, {})
        assert not parsed.broken, text[:cut]
        for call in parsed.calls:
            assert '{"a": 1, "b": 2.5}'.startswith(call.arguments)
            assert not call.complete


def test_text_that_is_no_call_is_broken_and_then_content() -> None:
    reader = ToolCallReader(hermes, NAMES)
    for text in ("<tool_call>not json</tool_call>", hermes_call("rm_rf", "{}"),
                 '<tool_call>{"name": "add", "arguments": [1]}</tool_call>'):  # fmt: skip
        answer = read_calls(reader, text)
        assert answer.tool_calls == [] and answer.content == text


def test_hermes_holds_back_what_may_begin_a_call() -> None:
    assert hermes("Sure <tool_", False, {}).content == "Sure "
    assert hermes("Sure <tool_", True, {}).content == "Sure <tool_"


def test_llama3_json_reads_calls_separated_by_semicolons() -> None:
    text = (
        '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "now", "parameters": {}}'
    )
    parsed = llama3_json(text, True, {})
    assert [(c.name, c.arguments) for c in parsed.calls] == [("add", '{"a": 1}'), ("now", "{}")]
    assert llama3_json("Hello there", True, {}).calls == ()
    assert llama3_json("Hello there", True, {}).content == "Hello there"


def test_qwen3_xml_builds_json_from_typed_parameters() -> None:
    text = ("Working.\n<tool_call>\n<function=add>\n<parameter=a>\n3\n</parameter>\n"
            "<parameter=b>\n2.5\n</parameter>\n<parameter=note>\n42\n</parameter>\n"
            "</function>\n</tool_call>")  # fmt: skip
    parsed = qwen3_xml(text, True, TYPES)
    (call,) = parsed.calls
    assert parsed.content == "Working.\n" and call.name == "add" and call.complete
    assert json.loads(call.arguments) == {"a": 3, "b": 2.5, "note": "42"}


def stream_all(reader: ToolCallReader, text: str, cuts: list[int]) -> tuple[str, list[dict]]:
    """Feed the text in pieces; accumulate as the openai client does."""
    stream = ToolCallStream(reader)
    content, calls = "", {}
    for end in [*cuts, len(text)]:
        piece, deltas = stream.feed(text[:end], final=end == len(text))
        content += piece
        for delta in deltas:
            call = calls.setdefault(delta["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in delta:
                assert call["id"] is None  # id and name exactly once
                call["id"], call["name"] = delta["id"], delta["function"]["name"]
            call["arguments"] += delta["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_streamed_deltas_add_up_to_the_whole_answer(name: str) -> None:
    texts = {
        "hermes": "Hi "
        + hermes_call("add", '{"a": 1, "b": {"c": "}"}}')
        + hermes_call("now", "{}"),
        "llama3_json": '{"name": "add", "parameters": {"a": 1, "b": "x;y"}}; {"name": "now"}',
        "qwen3_xml": (
            "<tool_call>\n<function=add>\n<parameter=a>\n7\n</parameter>\n</function>\n</tool_call>"
        ),
    }
    reader = ToolCallReader(PARSERS[name], NAMES, TYPES)
    text = texts[name]
    whole = read_calls(reader, text)
    for step in (1, 2, 5):
        content, calls = stream_all(reader, text, list(range(0, len(text), step)))
        assert (content or None) == whole.content
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in whole.tool_calls
        ]


SOUP = '<tool_call>{}[]":,; \n\\abnmeargus0123|python_tagfuncio=/'


@given(st.text(alphabet=st.sampled_from(SOUP), max_size=120), st.sampled_from(sorted(PARSERS)))
def test_any_text_never_raises_and_streams_consistently(text: str, name: str) -> None:
    reader = ToolCallReader(PARSERS[name], NAMES | {"a", "b"}, TYPES)
    whole = read_calls(reader, text)
    content, calls = stream_all(reader, text, list(range(0, len(text), 3)))
    if whole.tool_calls:
        streamed = [(c["name"], c["arguments"]) for c in calls]
        expected = [(c["function"]["name"], c["function"]["arguments"]) for c in whole.tool_calls]
        assert streamed == expected and (content or None) == whole.content
    elif not calls:
        assert content == text


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)


@given(
    st.text(alphabet=st.characters(blacklist_characters="<"), max_size=20),
    st.lists(st.tuples(st.sampled_from(sorted(NAMES)),
                       st.dictionaries(st.text(max_size=5), JSON_VALUES, max_size=3)),
             min_size=1, max_size=3),
    st.sampled_from([None, 0, 2]),
    st.integers(1, 7),
)  # fmt: skip
def test_generated_hermes_calls_stream_as_they_read(
    before: str, calls: list[tuple[str, dict]], indent: int | None, step: int
) -> None:
    text = before + "".join(hermes_call(n, json.dumps(a, indent=indent)) for n, a in calls)
    reader = ToolCallReader(hermes, NAMES)
    whole = read_calls(reader, text)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in whole.tool_calls] == calls  # fmt: skip
    assert whole.content == (before or None)
    content, streamed = stream_all(reader, text, list(range(0, len(text), step)))
    assert [(c["name"], c["arguments"]) for c in streamed] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole.tool_calls
    ]
    assert content == before
