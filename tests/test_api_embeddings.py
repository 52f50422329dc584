"""/v1/embeddings and /encode against the fake engine (vectors [len, sum % 7, 1, 0.5] of
its tokens, which are characters mod 100): shapes, input forms, fields, refusals."""

from __future__ import annotations

import base64
import re
import struct

import pytest
from quart.typing import TestClientProtocol as QuartClient

from api.app import create_app
from api.http.state import ServerSettings
from runtime.protocol import PoolingParams
from tests.api_helpers import MODEL
from tests.fake_engine import FakeEngine


async def test_the_openai_shape_in_floats_and_base64(client: QuartClient) -> None:
    body = {"model": MODEL, "input": ["ab", "c"], "user": "u"}
    floats = await client.post("/v1/embeddings", json=body)
    encoded = await client.post("/v1/embeddings", json=body | {"encoding_format": "base64"})
    answer = await floats.get_json()
    assert "X-Ignored-Fields" not in floats.headers  # `user` is taken (and does nothing)
    assert answer == {
        "object": "list",
        "data": [
            {"object": "embedding", "index": 0, "embedding": [2.0, 6.0, 1.0, 0.5]},
            {"object": "embedding", "index": 1, "embedding": [1.0, 1.0, 1.0, 0.5]},
        ],
        "model": MODEL,
        "usage": {"prompt_tokens": 3, "total_tokens": 3},
    }
    for entry, packed in zip(answer["data"], (await encoded.get_json())["data"], strict=True):
        raw = base64.b64decode(packed["embedding"])  # little-endian float32
        assert list(struct.unpack("<4f", raw)) == entry["embedding"]


@pytest.mark.parametrize(
    ("given", "inputs"),
    [
        ("hi", ["hi"]),
        (["hi", "yo"], ["hi", "yo"]),
        ([5, 6], [[5, 6]]),
        ([[5, 6], [7]], [[5, 6], [7]]),
    ],
)
async def test_every_input_form(
    client: QuartClient, engine: FakeEngine, given: object, inputs: list
) -> None:
    response = await client.post("/v1/embeddings", json={"model": MODEL, "input": given})
    assert response.status_code == 200
    assert engine.embedded[0][0] == inputs


async def test_pooling_fields_reach_the_engine(client: QuartClient, engine: FakeEngine) -> None:
    extra = {"normalize": False, "dimensions": 2, "truncate_prompt_tokens": -1}
    body = {"model": MODEL, "input": "x", "pooling_type": "mean", **extra, "colour": 1}
    response = await client.post("/v1/embeddings", json=body)
    assert response.status_code == 200 and response.headers["X-Ignored-Fields"] == "colour"
    assert len((await response.get_json())["data"][0]["embedding"]) == 2
    assert engine.embedded[0][1] == PoolingParams("mean", False, 2, -1)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": ""}, "input", "at least 1 character"),
        ({"input": [[1], [1, 100]]}, "input[1]", "must be ints in \\[0, 100\\)"),  # the engine's
        ({"input": "x", "dimensions": 8}, "dimensions", "matryoshka"),
        ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "-1 or at least"),
        ({"input": ["a", "b", "c"]}, "input", "at most 2 \\(--max-embedding-inputs\\)"),
        ({"input": "x", "embed_dtype": "float16"}, "embed_dtype", "only float32"),
    ],
)
async def test_bad_input_is_a_400_naming_the_field(body: dict, param: str, words: str) -> None:
    settings = ServerSettings(served_model_name=MODEL, max_embedding_inputs=2)
    async with create_app(FakeEngine(), settings).test_app() as app:
        response = await app.test_client().post("/v1/embeddings", json={"model": MODEL, **body})
        error = (await response.get_json())["error"]
    assert response.status_code == 400 and error["param"] == param, error
    assert re.search(words, error["message"]), error


async def test_sglang_encode_one_input_or_a_batch(client: QuartClient) -> None:
    one = await client.post("/encode", json={"text": "ab", "rid": "r1", "sampling_params": {}})
    assert await one.get_json() == {
        "embedding": [2.0, 6.0, 1.0, 0.5],
        "meta_info": {
            "id": "r1",
            "finish_reason": {"type": "length", "length": 0},
            "prompt_tokens": 2,
            "cached_tokens": 0,
        },
    }
    batch = await client.post("/encode", json={"input_ids": [[5], [6, 7]], "rid": ["a", "b"]})
    answers = await batch.get_json()
    assert [a["meta_info"]["id"] for a in answers] == ["a", "b"]
    assert [a["embedding"][0] for a in answers] == [1.0, 2.0]
    both = await client.post("/encode", json={"text": "a", "input_ids": [1]})
    assert (await both.get_json())["error"]["param"] == "text"
    short = await client.post("/encode", json={"text": ["a", "b"], "rid": ["a"]})
    assert (await short.get_json())["error"]["param"] == "rid"
