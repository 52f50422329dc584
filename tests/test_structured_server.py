"""Structured output end to end on the tiny llama: `runtime serve`, the official openai
client, SGLang's /generate. A model of random weights has no wish to write JSON at all, so
every output here that parses is the grammar's doing."""

from __future__ import annotations

import json
import random
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import trio

from tests.server_process import ServerProcess

PROMPT = "The tuple object"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,7}$"},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["admin", "user", "guest"]},
        "scores": {
            "type": "array",
            "items": {"type": "array", "items": {"type": "integer", "minimum": -5}, "maxItems": 2},
            "minItems": 1,
            "maxItems": 2,
        },
        "address": {
            "type": "object",
            "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["zip"],
        },
    },
    "required": ["name", "age", "role", "scores", "address"],
}
# a GBNF grammar and a Lark one, each with a regex of the same (finite) language
GBNF = 'root ::= "(" num ("+" num)? ")"\nnum ::= [1-9] [0-9]? [0-9]?'
LARK = 'start: WORD ("," WORD)?\nWORD: /[a-z]{2,4}/'
LANGUAGES = {GBNF: r"\([1-9][0-9]{0,2}(\+[1-9][0-9]{0,2})?\)", LARK: r"[a-z]{2,4}(,[a-z]{2,4})?"}


@pytest.fixture(scope="module")
def server(control_server: ServerProcess) -> ServerProcess:
    """The session's shared tiny server (float32): nothing here steers it."""
    return control_server


@pytest.fixture(scope="module")
def oai(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def strict_schema() -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}


def test_json_schema_outputs_validate_greedy_and_sampled(oai: openai.OpenAI) -> None:
    """Objects, enums, nested arrays, required fields, patterns and integer bounds, at
    temperature 0 and at 1 with four seeds (n=4: seeds 5 to 8), in one batch."""

    def ask(temperature: float, n: int) -> Any:
        return oai.chat.completions.create(  # type: ignore[call-overload]
            model="tiny",
            messages=[{"role": "user", "content": "A person, please."}],
            max_tokens=300,
            temperature=temperature,
            seed=5,
            n=n,
            response_format=strict_schema(),
        )

    with ThreadPoolExecutor(2) as pool:
        replies = list(pool.map(ask, (0.0, 1.0), (1, 4)))
    for reply in replies:
        for choice in reply.choices:
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)


def test_regexes_choices_and_grammars_hold(oai: openai.OpenAI) -> None:
    def texts(n: int, **constraint: object) -> list[str]:
        reply = oai.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=40, temperature=1.0, seed=1, n=n,
            extra_body=constraint,
        )  # fmt: skip
        assert all(c.finish_reason == "stop" for c in reply.choices)
        return [c.text for c in reply.choices]

    for text in texts(3, guided_regex=r"[0-9]{3}-[a-z]{2,5}(\.[a-z]+)?"):
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,5}(\.[a-z]+)?", text)
    assert set(texts(6, guided_choice=["red", "green", "blue"])) <= {"red", "green", "blue"}
    for grammar, language in LANGUAGES.items():
        for text in texts(3, guided_grammar=grammar):
            assert re.fullmatch(language, text), (grammar, text)


def test_the_three_apis_spell_the_same_output(server: ServerProcess, oai: openai.OpenAI) -> None:
    """OpenAI's response_format, vLLM's structured_outputs and guided_*, SGLang's /generate
    fields: one constraint, one output at temperature 0, streamed or not."""
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 300,
            "temperature": 0}  # fmt: skip
    closed = json.loads(json.dumps(SCHEMA))  # what strict means, said by the schema itself
    closed["additionalProperties"] = closed["properties"]["address"]["additionalProperties"] = False
    vllm = {"json": SCHEMA, "disable_additional_properties": True}
    shapes = [
        {"response_format": strict_schema()},
        {"extra_body": {"structured_outputs": vllm}},
        {"extra_body": {"guided_json": closed}},
    ]
    with ThreadPoolExecutor(3) as pool:  # one batch: greedy in float32 is the same in any
        texts = list(pool.map(lambda shape: oai.chat.completions.create(**chat, **shape), shapes))  # type: ignore[call-overload]
    ids = httpx.post(server.url + "/tokenize", json={"messages": chat["messages"]}).json()
    sampling = {"max_new_tokens": 300, "temperature": 0, "json_schema": json.dumps(closed)}
    native = {"input_ids": ids["tokens"], "sampling_params": sampling}
    sglang = httpx.post(server.url + "/generate", json=native).json()["text"]
    assert [t.choices[0].message.content for t in texts] == [sglang] * 3
    jsonschema.validate(json.loads(sglang), closed)
    common = {"model": "tiny", "prompt": PROMPT, "max_tokens": 40, "temperature": 0}
    for constraint, (key, source) in (
        ({"structured_outputs": {"regex": "[a-c]{1,9}!"}}, ("regex", "[a-c]{1,9}!")),
        ({"guided_grammar": GBNF}, ("ebnf", GBNF)),
    ):
        whole = oai.completions.create(**common, extra_body=constraint).choices[0].text  # type: ignore[call-overload]
        streamed = oai.completions.create(**common, extra_body=constraint, stream=True)  # type: ignore[call-overload]
        assert "".join(c.choices[0].text for c in streamed) == whole
        sampling = {"max_new_tokens": 40, "temperature": 0, key: source}
        body = {"text": PROMPT, "sampling_params": sampling}
        assert httpx.post(server.url + "/generate", json=body).json()["text"] == whole


async def test_an_unconstrained_request_is_unchanged_beside_constrained_ones(
    server: ServerProcess,
) -> None:
    """Its greedy output is its solo run's, computed while three constrained requests (its
    batch-mates from start to end) stream."""
    # short, so that the constrained streams below outlast it on a loaded machine too
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    regex = "[a-z ]{700,800}"  # some 150 tokens of the tiny vocabulary's
    constrained = body | {"max_tokens": 1000, "guided_regex": regex, "stream": True}
    texts: dict[int, str] = {}
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        alone = (await client.post("/v1/completions", json=body)).json()["choices"][0]["text"]

        async def stream(i: int, started: trio.Event) -> None:
            request = constrained | {"temperature": 1, "seed": i}
            chunks = []
            async with client.stream("POST", "/v1/completions", json=request) as response:
                async for line in response.aiter_lines():
                    started.set()
                    chunks += [line] if line.strip() else []
            events = [json.loads(c.removeprefix("data: ")) for c in chunks[:-1]]
            texts[i] = "".join(e["choices"][0]["text"] for e in events)

        async with trio.open_nursery() as nursery:
            for i in range(3):
                started = trio.Event()
                nursery.start_soon(stream, i, started)
                await started.wait()
            beside = (await client.post("/v1/completions", json=body)).json()
            assert not texts  # the constrained ones still run
    assert beside["choices"][0]["text"] == alone
    assert all(re.fullmatch(regex, text) for text in texts.values()) and len(texts) == 3


def test_logprobs_are_of_the_constrained_distribution(oai: openai.OpenAI) -> None:
    """As vLLM reports them: the grammar's mask applies first, so the tokens it forbids have
    no probability (-9999.0: JSON has no -inf) and the allowed ones share all of it."""
    choices = ["yes", "no", "maybe"]
    reply = oai.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=20,
        extra_body={"guided_choice": choices},
    ).choices[0]  # fmt: skip
    assert reply.text in choices and reply.logprobs is not None
    first = reply.logprobs.top_logprobs[0]  # type: ignore[index]
    allowed = {token: lp for token, lp in first.items() if lp > -9999.0}
    assert allowed and all(any(c.startswith(t) for c in choices) for t in allowed)
    assert sum(2.718281828459045**lp for lp in allowed.values()) == pytest.approx(1.0, abs=1e-3)


BAD = [
    ({"guided_regex": "[0-9"}, "the regex"),
    ({"guided_json": {"type": "string", "format": "colour"}}, "the JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 7}}}}, "JSON"),
    ({"guided_grammar": 'root ::= "a" | missing'}, "the grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "give one of"),
    ({"structured_outputs": {"json": '{"a": ' * 70 + "1" + "}" * 70}}, "nested deeper"),
    ({"guided_regex": "a" * 140_000}, "guided_regex"),
    ({"structural_tag": {"structures": [{"begin": "<x>"}], "triggers": []}}, "structural tag"),
]
GOOD = [
    ({"guided_regex": "[0-9]{2}"}, r"[0-9]{2}"),
    ({"guided_choice": ["up", "down"]}, r"up|down"),
    ({"guided_json": {"enum": [1, 2, 3]}}, r"[123]"),
]


async def test_bad_constraints_are_400s_between_good_requests(server: ServerProcess) -> None:
    """vLLM lost its engine to one bad structured_outputs (vllm#45346, #43920, #17248)."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    mix = [(True, *b) for b in BAD] + [(False, *rng.choice(GOOD)) for _ in range(12)]
    rng.shuffle(mix)
    base = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 1}
    failures: list[str] = []
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:

        async def send(bad: bool, fields: Any, expected: str) -> None:
            await trio.sleep(rng.random() * 0.2)
            answer = await client.post("/v1/completions", json=base | fields)
            if bad and not (answer.status_code == 400 and expected in answer.text):
                failures.append(f"{fields}: {answer.status_code} {answer.text[:200]}")
            if not bad and not (
                answer.status_code == 200
                and re.fullmatch(expected, answer.json()["choices"][0]["text"])
            ):
                failures.append(f"{fields}: {answer.status_code} {answer.text[:200]}")

        async with trio.open_nursery() as nursery:
            for item in mix:
                nursery.start_soon(send, *item)
        assert not failures, f"seed {seed}: {failures}"
        assert (await client.get("/health")).status_code == 200
