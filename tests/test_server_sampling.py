"""Sampling and output options end to end: `runtime serve` in float32, the official openai
client (completions and chat, streamed and not), SGLang's /generate and our trio client."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import trio

from api.client import Client
from tests.server_process import ServerProcess, metric, wait_until

PROMPT = "The tuple object"


@pytest.fixture(scope="module")
def server(llama_dir: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(llama_dir, "--max-model-len", "256", "--dtype", "float32")
    yield proc
    assert proc.terminate() == 0, proc.log


@pytest.fixture(scope="module")
def oai(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def generate(server: ServerProcess, **body: object) -> object:
    response = httpx.post(server.url + "/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_completion_logprobs_streamed_and_not(oai: openai.OpenAI, server: ServerProcess) -> None:
    kwargs = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 3}
    whole = oai.completions.create(**kwargs).choices[0]
    lp = whole.logprobs
    assert lp is not None and len(lp.tokens) == len(lp.token_logprobs) == 8
    assert "".join(lp.tokens) == whole.text  # no stop: the tokens spell the text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[token] == logprob and 3 <= len(top) <= 4  # the sampled token comes first
        assert logprob == max(top.values())  # greedy: the most likely
    chunks = list(oai.completions.create(**kwargs, stream=True))
    streamed = [
        t for c in chunks for t in (c.choices[0].logprobs.tokens if c.choices[0].logprobs else [])
    ]
    assert streamed == lp.tokens
    offsets = [
        o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset
    ]
    assert offsets == lp.text_offset
    # the same values from SGLang's route
    native = generate(
        server,
        text=PROMPT,
        sampling_params={"max_new_tokens": 8, "temperature": 0},
        return_logprob=True,
        top_logprobs_num=3,
        return_text_in_logprobs=True,
    )
    meta = native["meta_info"]
    assert [e[0] for e in meta["output_token_logprobs"]] == pytest.approx(lp.token_logprobs)
    assert [e[2] for e in meta["output_token_logprobs"]] == lp.tokens
    assert [len(t) for t in meta["output_top_logprobs"]] == [3] * 8
    assert meta["input_token_logprobs"][0][0] is None and len(meta["input_token_logprobs"]) == 1


def test_echo_scores_the_prompt(oai: openai.OpenAI, server: ServerProcess) -> None:
    choice = oai.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1, echo=True
    ).choices[0]
    assert choice.text.startswith(PROMPT)
    lp = choice.logprobs
    ids = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    assert len(lp.tokens) == len(ids) + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v < 0 for v in lp.token_logprobs[1:])
    native = generate(
        server,
        input_ids=ids,
        sampling_params={"max_new_tokens": 1},
        return_logprob=True,
        logprob_start_len=0,
    )
    inputs = native["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in inputs] == ids
    assert [e[0] for e in inputs][1:] == pytest.approx(lp.token_logprobs[1 : len(ids)], abs=1e-5)


def test_chat_logprobs_streamed_and_not(oai: openai.OpenAI) -> None:
    kwargs = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    whole = oai.chat.completions.create(**kwargs).choices[0]
    content = whole.logprobs.content
    assert len(content) == 6 and all(len(c.top_logprobs) == 2 for c in content)
    for c in content:
        assert c.top_logprobs[0].logprob == c.logprob  # greedy
        assert c.token == "" or c.bytes == list(c.token.encode())  # "": part of a character
    if whole.finish_reason == "length":  # no EOS: the tokens' bytes spell the text
        assert bytes(b for c in content for b in c.bytes).decode() == whole.message.content
    chunks = list(oai.chat.completions.create(**kwargs, stream=True))
    streamed = [
        c
        for ch in chunks
        for c in (ch.choices[0].logprobs.content if ch.choices and ch.choices[0].logprobs else [])
    ]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]


def test_n_samples_and_penalties_through_every_route(
    oai: openai.OpenAI, server: ServerProcess
) -> None:
    kwargs = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": 6,
        "temperature": 1.0,
        "seed": 3,
        "n": 3,
        "logprobs": 0,
    }
    whole = oai.completions.create(**kwargs)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert len({c.text for c in whole.choices}) == 3
    single = oai.completions.create(**(kwargs | {"n": 1}))
    assert whole.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counts once
    assert whole.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in whole.choices)
    streamed: dict[int, str] = {}
    for chunk in oai.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {c.index: c.text for c in whole.choices}
    chat = oai.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        n=2,
        seed=1,
        presence_penalty=1.0,
        frequency_penalty=0.5,
        logit_bias={"7": -100},
        extra_body={"repetition_penalty": 1.2, "min_tokens": 2, "bad_words": ["the"]},
    )
    assert [c.index for c in chat.choices] == [0, 1]
    bodies = generate(
        server,
        text=PROMPT,
        sampling_params={
            "max_new_tokens": 4,
            "n": 2,
            "seed": 5,
            "min_new_tokens": 4,
            "logit_bias": {"9": 5.0},
        },
    )
    assert isinstance(bodies, list) and [len(b["output_ids"]) for b in bodies] == [4, 4]


def test_logit_bias_forces_a_token(oai: openai.OpenAI) -> None:
    choice = oai.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, logit_bias={"42": 100}, logprobs=0
    ).choices[0]
    ids = choice.logprobs.tokens
    assert len(set(ids)) == 1  # token 42 every time


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ({"n": 0}, "n"),
        ({"n": 1000}, "n must be at most"),
        ({"best_of": 2}, "best_of"),
        ({"logprobs": 21}, "logprobs must be at most 20"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"1": 101}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, "vocabulary"),
        ({"min_tokens": 9, "max_tokens": 2}, "min_tokens"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
    ],
)
def test_bad_sampling_options_are_400s(server: ServerProcess, body: dict, match: str) -> None:
    response = httpx.post(
        server.url + "/v1/completions",
        json={"model": "tiny", "prompt": "x", "max_tokens": 2} | body,
    )
    assert response.status_code == 400, response.text
    assert match in response.text


async def test_trio_client_reads_logprobs(server: ServerProcess) -> None:
    async with Client(server.url) as client:
        completion = await client.completions(PROMPT, max_tokens=3, temperature=0, logprobs=2)
        assert completion.choices[0].logprobs is not None
        assert len(completion.choices[0].logprobs.tokens) == 3
        chat = await client.chat(
            [{"role": "user", "content": "Hi"}], max_tokens=3, logprobs=True, top_logprobs=1
        )
        assert chat.choices[0].logprobs is not None and len(chat.choices[0].logprobs) == 3
        answers = await client.generate(
            PROMPT, {"max_new_tokens": 2, "n": 2, "temperature": 0.5}, return_logprob=True
        )
        assert [len(a["meta_info"]["output_token_logprobs"]) for a in answers] == [2, 2]
        chunks = [
            c
            async for c in client.stream_chat(
                [{"role": "user", "content": "Hi"}], max_tokens=3, logprobs=True
            )
        ]
        assert sum(len(c.choices[0].logprobs or []) for c in chunks if c.choices) == 3


def test_the_sampled_token_is_listed_even_outside_the_top(oai: openai.OpenAI) -> None:
    lp = (
        oai.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=16, temperature=1.5, seed=2, logprobs=1
        )
        .choices[0]
        .logprobs
    )
    outside = [i for i, top in enumerate(lp.top_logprobs) if len(top) == 2]
    assert outside  # a hot temperature samples below the most likely token
    for i in outside:
        assert next(iter(lp.top_logprobs[i])) == lp.tokens[i]  # first, then the top one
        assert lp.token_logprobs[i] < max(lp.top_logprobs[i].values())


def test_streamed_samples_of_chat_and_generate(oai: openai.OpenAI, server: ServerProcess) -> None:
    kwargs = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 5,
        "n": 2,
        "seed": 4,
        "temperature": 1.0,
    }
    whole = oai.chat.completions.create(**kwargs)
    texts = {0: "", 1: ""}
    roles = []
    for chunk in oai.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            roles += [c.index] if c.delta.role else []
            texts[c.index] += c.delta.content or ""
    assert roles == [0, 1]
    assert texts == {c.index: c.message.content for c in whole.choices}
    body = {
        "text": PROMPT,
        "sampling_params": {"max_new_tokens": 3, "n": 2, "seed": 4},
        "return_logprob": True,
        "stream": True,
    }
    ids: dict[int, list[int]] = {0: [], 1: []}
    scored: dict[int, list[list]] = {0: [], 1: []}
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):  # only what is new in each event
                event = json.loads(line[6:])
                ids[event["index"]] += event["output_ids"]
                scored[event["index"]] += event["meta_info"]["output_token_logprobs"]
    answers = generate(server, **(body | {"stream": False}))
    assert [a["output_ids"] for a in answers] == [ids[0], ids[1]]
    assert [a["meta_info"]["output_token_logprobs"] for a in answers] == [scored[0], scored[1]]


def test_leaving_a_stream_of_samples_aborts_them_all(server: ServerProcess) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 200, "n": 4, "logprobs": 2,
            "ignore_eos": True, "stream": True}  # fmt: skip
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data: ")
            if chunks == 6:
                break  # leaving closes the connection mid-stream
    assert wait_until(
        lambda: (
            metric(server, "runtime:num_requests_running") == 0
            and metric(server, "runtime:kv_cache_usage_perc") == 0
        )
    )
    assert metric(server, "runtime:num_requests_waiting") == 0
    after = httpx.post(
        server.url + "/v1/completions", json=body | {"stream": False, "max_tokens": 2}
    )
    assert after.status_code == 200 and len(after.json()["choices"]) == 4


async def test_a_request_id_in_use_by_samples_is_refused(server: ServerProcess) -> None:
    body = {"text": PROMPT, "rid": "shared-rid",
            "sampling_params": {"max_new_tokens": 200, "n": 3, "ignore_eos": True}}  # fmt: skip
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        first = trio.Event()
        statuses: list[int] = []

        async def long_one() -> None:
            async with http.stream("POST", "/generate", json=body | {"stream": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        first.set()
                statuses.append(r.status_code)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(long_one)
            await first.wait()  # the request is open: its id is taken
            again = await http.post("/generate", json=body)
            assert again.status_code == 400 and "already in use" in again.text
        assert statuses == [200]
        reused = await http.post(
            "/generate", json=body | {"sampling_params": {"max_new_tokens": 1, "n": 2}}
        )
        assert reused.status_code == 200  # free again once that request ended
