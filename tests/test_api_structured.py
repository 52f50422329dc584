"""Structured output's fields against the fake engine: every API's spelling maps to the one
constraint the engine gets, compiled before anything is queued; more than one, or a bad one,
is a 400 naming the field."""

from __future__ import annotations

import json
from typing import Any

import pytest
from quart.typing import TestClientProtocol as QuartClient

from runtime.protocol import Constraint
from tests.api_helpers import MODEL
from tests.fake_engine import FakeEngine

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TEXT = json.dumps(SCHEMA)
OPENAI = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
JSON = Constraint("json", TEXT)


def json_schema(strict: bool | None = None) -> dict[str, Any]:
    spec = {"name": "thing", "description": "a thing", "schema": SCHEMA}
    return {"type": "json_schema", "json_schema": spec | ({"strict": strict} if strict else {})}


@pytest.mark.parametrize(
    ("path", "body", "constraint"),
    [
        ("/v1/chat/completions", CHAT | {"response_format": json_schema()}, JSON),
        (
            "/v1/chat/completions",
            CHAT | {"response_format": json_schema(strict=True)},
            Constraint("json", TEXT, strict=True),
        ),
        ("/v1/completions", OPENAI | {"response_format": json_schema()}, JSON),  # vLLM's
        (
            "/v1/chat/completions",
            CHAT | {"response_format": {"type": "json_object"}},
            Constraint("json_object"),
        ),
        ("/v1/chat/completions", CHAT | {"response_format": {"type": "text"}}, None),
        ("/v1/completions", OPENAI | {"guided_json": SCHEMA}, JSON),
        ("/v1/completions", OPENAI | {"guided_json": TEXT}, JSON),
        (
            "/v1/completions",
            OPENAI | {"guided_json": SCHEMA, "guided_whitespace_pattern": " ?"},
            Constraint("json", TEXT, whitespace_pattern=" ?"),
        ),
        (
            "/v1/completions",
            OPENAI | {"guided_regex": "a+", "guided_decoding_backend": "xgrammar"},
            Constraint("regex", "a+"),
        ),
        (
            "/v1/completions",
            OPENAI | {"guided_choice": ["x", "y"]},
            Constraint("choice", '["x", "y"]'),
        ),
        (
            "/v1/completions",
            OPENAI | {"guided_grammar": "root ::= [a]"},
            Constraint("grammar", "root ::= [a]"),
        ),
        ("/v1/completions", OPENAI | {"structured_outputs": {"json": SCHEMA}}, JSON),
        (
            "/v1/chat/completions",
            CHAT
            | {
                "structured_outputs": {
                    "json": TEXT,
                    "disable_any_whitespace": True,
                    "disable_additional_properties": True,
                }
            },
            Constraint("json", TEXT, compact=True, strict=True),
        ),
        (
            "/v1/completions",
            OPENAI | {"structured_outputs": {"choice": ["x"]}},
            Constraint("choice", '["x"]'),
        ),
        (
            "/v1/completions",
            OPENAI | {"structured_outputs": {"json_object": True}},
            Constraint("json_object"),
        ),
        ("/v1/completions", OPENAI | {"json_schema": TEXT}, JSON),  # SGLang's OpenAI routes
        (
            "/v1/chat/completions",
            CHAT | {"ebnf": 'root ::= "a"'},
            Constraint("grammar", 'root ::= "a"'),
        ),
        (
            "/generate",
            {"text": "hi", "sampling_params": {"max_new_tokens": 2, "json_schema": TEXT}},
            JSON,
        ),
        (
            "/generate",
            {"text": "hi", "sampling_params": {"max_new_tokens": 2, "regex": "b+"}},
            Constraint("regex", "b+"),
        ),
        (
            "/generate",
            {"text": "hi", "sampling_params": {"max_new_tokens": 2, "ebnf": "root ::= [b]"}},
            Constraint("grammar", "root ::= [b]"),
        ),
        (
            "/generate/",
            {"prompts": ["hi"], "structured_outputs_regex": "c"},
            Constraint("regex", "c"),
        ),
    ],
)
async def test_every_spelling_is_one_constraint(
    client: QuartClient,
    engine: FakeEngine,
    path: str,
    body: dict[str, Any],
    constraint: Constraint | None,
) -> None:
    response = await client.post(path, json=body)
    assert response.status_code == 200, await response.get_data()
    assert "X-Ignored-Fields" not in response.headers
    (_, params, _), *_ = engine.requests
    assert params.constraint == constraint
    assert engine.compiled == ([constraint] if constraint else [])  # before it was queued


async def test_a_structural_tag_is_one_constraint_too(
    client: QuartClient, engine: FakeEngine
) -> None:
    tag = {"structures": [{"begin": "<f=a>", "schema": SCHEMA, "end": "</f>"}], "triggers": ["<f="]}
    fmt = {"type": "structural_tag"} | tag
    await client.post("/v1/chat/completions", json=CHAT | {"response_format": fmt})
    await client.post(
        "/generate",
        json={"text": "hi", "sampling_params": {"max_new_tokens": 2, "structural_tag": tag}},
    )
    assert [p.constraint for _, p, _ in engine.requests] == [
        Constraint("structural_tag", json.dumps(tag))
    ] * 2


@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [
        (
            "/v1/completions",
            OPENAI | {"guided_regex": "a", "response_format": json_schema()},
            "response_format",
            "give one of guided_regex and response_format",
        ),
        (
            "/v1/completions",
            OPENAI | {"structured_outputs": {"regex": "a", "choice": ["b"]}},
            "structured_outputs.choice",
            "give one of",
        ),
        (
            "/v1/chat/completions",
            CHAT | {"response_format": {"type": "json_schema"}},
            "response_format.json_schema",
            "is required",
        ),
        ("/v1/completions", OPENAI | {"guided_regex": "invalid"}, None, "the regex is invalid"),
        (
            "/generate",
            {"text": "hi", "sampling_params": {"max_new_tokens": 2, "json_schema": "invalid"}},
            None,
            "json is invalid",
        ),
        (
            "/v1/completions",
            OPENAI | {"guided_json": {"a": "x" * 140_000}},
            "guided_json",
            "at most 131072",
        ),
        (
            "/v1/completions",
            OPENAI
            | {
                "structured_outputs": {
                    "json_object": True,
                    "disable_any_whitespace": True,
                    "whitespace_pattern": " ",
                }
            },
            "structured_outputs.json_object",
            "not both",
        ),
    ],
)
async def test_bad_constraints_are_400s_and_nothing_is_queued(
    client: QuartClient,
    engine: FakeEngine,
    path: str,
    body: dict[str, Any],
    param: str | None,
    message: str,
) -> None:
    response = await client.post(path, json=body)
    assert response.status_code == 400
    error = (await response.get_json())["error"]
    assert error["param"] == param and message in error["message"], error
    assert error["code"] == "invalid_value" and not engine.requests
