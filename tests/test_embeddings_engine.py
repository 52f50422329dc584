"""`Engine.embed` on the real frontend and scheduler actor with the model-free worker
(tests/fake_worker.py: an input's vector is its length and last token): order, validation,
truncation, and an embedding's end however it ends: vector, abort, cancel, refusal."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import trio
import trio.testing

from runtime.frontend.engine import Engine
from runtime.protocol import FieldError, PoolingParams, RequestAbortedError
from tests.engine_helpers import NUM_BLOCKS, fake_engine
from tests.fake_worker import fake_vector


async def at_rest(engine: Engine) -> None:
    stats = (await engine.fetch_statistics()).scheduler
    assert (stats.num_running, stats.num_waiting, stats.num_free_blocks) == (0, 0, NUM_BLOCKS)
    assert engine.statistics().frontend.num_requests_open == 0


async def test_one_vector_per_input_in_input_order(llama_dir: Path) -> None:
    inputs = [[5, 6, 7] * 9, [9], [3, 4]]  # 27 tokens: chunked over three steps of 12
    async with fake_engine(llama_dir, 2) as engine:
        results = await engine.embed(inputs)
        truncated = await engine.embed(
            [list(range(1, 36)) * 2], PoolingParams(truncate_prompt_tokens=5)
        )
        stats = (await engine.fetch_statistics()).scheduler
        await at_rest(engine)
    assert [r.index for r in results] == [0, 1, 2]
    assert [r.data for r in results] == [fake_vector(p) for p in inputs]
    assert [r.num_prompt_tokens for r in results] == [27, 1, 2]
    assert results[1].embedding == [1.0, 9.0]
    (cut,) = truncated  # the last 5 of 70 tokens (vLLM's side), which fit the 64 of the context
    assert (cut.num_prompt_tokens, cut.data) == (5, struct.pack("<2f", 5, 35))
    assert (stats.num_embeddings, stats.num_embedding_tokens, stats.num_generated_tokens) == (
        4,
        35,
        0,
    )


@pytest.mark.parametrize(
    ("inputs", "params", "field", "words"),
    [
        ([], None, "inputs", "must not be empty"),
        ("a text", None, "inputs", "a list of texts"),
        ([""], None, "inputs[0]", "empty string"),
        ([[1], []], None, "inputs[1]", "empty list"),
        ([[1], [2, 2.5]], None, "inputs[1]", "must be ints in \\[0, 4096\\)"),
        ([[4096]], None, "inputs[0]", "must be ints in \\[0, 4096\\)"),
        ([{"a": 1}], None, "inputs[0]", "a text or a list of token ids"),
        ([[1] * 65], None, "inputs[0]", "maximum context length is 64 tokens"),
        ([[1]], PoolingParams(truncate_prompt_tokens=65), "truncate_prompt_tokens", "greater"),
        ([[1]], PoolingParams(dimensions=8), "dimensions", "matryoshka"),
    ],
)
async def test_bad_input_names_its_field(
    llama_dir: Path, inputs: object, params: PoolingParams | None, field: str, words: str
) -> None:
    async with fake_engine(llama_dir, 2) as engine:
        with pytest.raises(FieldError, match=words) as caught:
            await engine.embed(inputs, params)  # type: ignore[arg-type]
        assert caught.value.field == field
        await at_rest(engine)


def test_pooling_params_name_their_field() -> None:
    for kwargs, field in [
        ({"pooling_type": "max"}, "pooling_type"),
        ({"dimensions": 0}, "dimensions"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ]:
        with pytest.raises(FieldError) as caught:
            PoolingParams(**kwargs)  # type: ignore[arg-type]
        assert caught.value.field == field


async def test_aborted_cancelled_and_refused_embeddings_end_cleanly(
    llama_dir: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with fake_engine(llama_dir, 2) as engine, trio.open_nursery() as nursery:
        await engine.control.pause("keep")  # they wait, held, until aborted or cancelled
        aborted = trio.Event()

        async def embed_then_be_aborted() -> None:
            with pytest.raises(RequestAbortedError):
                await engine.embed([[5, 6], [7]], rid="e")
            aborted.set()

        nursery.start_soon(embed_then_be_aborted)
        while not engine.abort("e"):  # once its inputs are open
            await trio.lowlevel.checkpoint()
        await aborted.wait()
        with trio.move_on_after(5):
            await engine.embed([[5, 6, 7]])  # cancelled while held
        await engine.control.resume()
        with pytest.raises(ValueError, match="refused"):  # the worker's vocabulary is 50
            await engine.embed([[5], [100]])
        await at_rest(engine)
        assert (await engine.embed([[8]]))[0].data == fake_vector([8])  # still serving
        nursery.cancel_scope.cancel()
