"""Embeddings from `runtime serve` end to end: the official openai client unmodified (it asks
for base64), our trio client, SGLang's /encode, 400s naming the field, the counters, and a
burst of embeddings beside a streamed greedy generation, which it must not change."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import trio
from transformers import AutoTokenizer

from api.client import Client
from tests.engine_helpers import random_prompts
from tests.server_process import ServerProcess, metric

TEXTS = ["The tuple object", "Lists are mutable sequences.", "A dict maps keys to values"]


@pytest.fixture(scope="module")
def server(llama_dir: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        llama_dir, "--dtype", "float32", "--max-model-len", "256", "--max-embedding-inputs", "8"
    )
    yield proc
    assert proc.terminate() == 0, proc.log


@pytest.fixture(scope="module")
def oai(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_the_openai_client_gets_base64_that_equals_the_float_answer(
    oai: openai.OpenAI, server: ServerProcess, llama_dir: Path
) -> None:
    default = oai.embeddings.create(model="tiny", input=TEXTS)  # the client asks for base64
    floats = oai.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    assert [d.embedding for d in default.data] == [d.embedding for d in floats.data]
    assert [d.index for d in default.data] == [0, 1, 2] and default.model == "tiny"
    singles = [oai.embeddings.create(model="tiny", input=t).data[0].embedding for t in TEXTS]
    for one, batched in zip(singles, floats.data, strict=True):  # to float32 rounding
        assert max(abs(a - b) for a, b in zip(one, batched.embedding, strict=True)) < 1e-6
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    ids = [tokenizer(t).input_ids for t in TEXTS]
    assert default.usage.prompt_tokens == sum(len(i) for i in ids) == default.usage.total_tokens
    by_ids = oai.embeddings.create(model="tiny", input=ids, encoding_format="float")
    assert [d.embedding for d in by_ids.data] == [d.embedding for d in floats.data]
    raw = httpx.post(server.url + "/v1/embeddings", json={"model": "tiny", "input": TEXTS[0]})
    answer = raw.json()
    assert list(answer) == ["object", "data", "model", "usage"] and answer["object"] == "list"
    assert answer["data"][0]["object"] == "embedding"
    assert answer["data"][0]["embedding"] == floats.data[0].embedding


async def test_our_client_and_sglang_encode(server: ServerProcess, oai: openai.OpenAI) -> None:
    reference = oai.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    async with Client(server.url) as client:
        ours = await client.embed(TEXTS)
        mean = await client.embed(TEXTS[0], pooling_type="mean", normalize=False)
    assert [d.embedding for d in ours.data] == [d.embedding for d in reference.data]
    assert ours.prompt_tokens == reference.usage.prompt_tokens
    assert mean.data[0].embedding != reference.data[0].embedding
    async with httpx.AsyncClient(base_url=server.url) as http:
        one = (await http.post("/encode", json={"text": TEXTS[0], "rid": "q"})).json()
        batch = (await http.post("/encode", json={"text": TEXTS[:2]})).json()
    assert one["embedding"] == reference.data[0].embedding
    assert one["meta_info"]["id"] == "q" and one["meta_info"]["prompt_tokens"] > 0
    assert [b["embedding"] for b in batch] == [d.embedding for d in reference.data[:2]]


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"input": ""}, "input", "invalid_value"),
        ({"input": []}, "input", "invalid_value"),
        ({"input": [[1, 2], []]}, "input[1]", "invalid_value"),
        ({"input": [1, 2.5]}, "input[1]", "invalid_value"),
        ({"input": [[5, 4096]]}, "input[0]", "invalid_value"),  # the vocabulary is 4096
        ({"input": ["x"] * 9}, "input", "too_many_inputs"),  # --max-embedding-inputs 8
        ({"input": [[5] * 257]}, "input[0]", "context_length_exceeded"),
        ({"input": "x", "dimensions": 8}, "dimensions", "invalid_value"),  # not matryoshka
        ({"input": "x", "truncate_prompt_tokens": 300}, "truncate_prompt_tokens", "invalid_value"),
        ({"input": "x", "encoding_format": "bytes"}, "encoding_format", "invalid_value"),
        ({"input": "x", "pooling_type": "max"}, "pooling_type", "invalid_value"),
        ({"messages": [{"role": "user", "content": "x"}]}, "messages", "unsupported_parameter"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(
    server: ServerProcess, body: dict, param: str, code: str
) -> None:
    response = httpx.post(server.url + "/v1/embeddings", json={"model": "tiny", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, code), error


async def test_an_embedding_burst_leaves_streamed_greedy_ids_unchanged(
    server: ServerProcess,
) -> None:
    greedy = {"max_new_tokens": 128, "temperature": 0}
    body = {"text": "Once upon a time", "sampling_params": greedy}
    long_inputs = random_prompts([200, 120, 60, 30, 7, 1], seed=11)  # prefill chunks galore
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http, Client(server.url) as c:
        alone = (await http.post("/generate", json=body)).json()["output_ids"]
        streamed: list[int] = []
        counts: list[int] = []
        stream = http.stream("POST", "/generate", json=body | {"stream": True})
        async with trio.open_nursery() as nursery, stream as events:
            async for line in events.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                if not streamed:  # generating: now the burst comes
                    for i in range(8):  # ~3,300 prompt tokens: 7+ steps of 512
                        nursery.start_soon(burst, c, long_inputs[i % 6 :], counts)
                streamed += json.loads(line[len("data: ") :])["output_ids"]
            overlapped = len(counts)  # calls answered while the stream was still going
    assert streamed == alone and len(alone) == 128
    assert overlapped > 0, "the burst came after the generation: nothing was tested"
    assert sum(counts) == sum(len(long_inputs[i % 6 :]) for i in range(8))
    assert metric(server, "runtime:embedding_requests_total") >= sum(counts)


async def burst(client: Client, inputs: list[list[int]], counts: list[int]) -> None:
    answer = await client.embed(inputs)
    counts.append(len(answer.data))
