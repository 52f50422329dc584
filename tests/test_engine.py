"""The engine end to end: aborts, cancellation, seeds and bad input, in both actor modes."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from runtime.config.engine import EngineConfig
from runtime.config.sampling import SamplingParams
from runtime.frontend.engine import Engine
from runtime.frontend.launch import open_engine
from tests.engine_helpers import collect, collect_all, random_prompts

MODES = ["inproc", "process"]


def config(model: Path, mode: str, **overrides: object) -> EngineConfig:
    # float32 everywhere: bf16 GEMMs may round differently for another batch size, and these
    # tests compare tokens across batches (and the CI machine may lack native bf16)
    return EngineConfig(model=str(model), mode=mode, max_model_len=512, dtype="float32").replace(
        **overrides
    )


@pytest.mark.parametrize("mode", MODES)
async def test_abort_100_of_200_in_flight_frees_every_block(llama_dir: Path, mode: str) -> None:
    prompts = random_prompts([5 + i % 40 for i in range(200)], seed=2)
    finished: list[str] = []
    all_started = trio.Event()
    started = 0
    counted = [False] * 200

    async def request(engine: Engine, i: int) -> None:
        nonlocal started
        abandon = i % 2 == 1  # the odd half gets abandoned mid-generation
        # ignore_eos: only abandonment or the length ends a request (an abandoned one that
        # sampled EOS before the last request started would finish on its own)
        params = SamplingParams(max_tokens=300 if abandon else 24, temperature=0.0, ignore_eos=True)
        with trio.CancelScope() as scope:
            async for out in engine.generate(prompts[i], params):
                if out.finished:
                    finished.append(out.finish_reason or "")
                if not counted[i]:
                    counted[i], started = True, started + 1
                    if started == 200:
                        all_started.set()
                if abandon and all_started.is_set():
                    if i % 4 == 1:
                        scope.cancel()  # cancelled, as a disconnect or a deadline would
                    else:
                        break  # or the consumer simply stops iterating
                await trio.lowlevel.checkpoint()

    async with open_engine(config(llama_dir, mode, max_num_seqs=256)) as engine:
        async with trio.open_nursery() as nursery:
            for i in range(200):
                nursery.start_soon(request, engine, i)
        stats = await engine.fetch_statistics()
    assert finished == ["length"] * 100
    assert stats.scheduler.num_aborts == 100  # exactly one abort per abandoned request
    assert stats.kv_cache_usage == 0.0
    assert stats.scheduler.num_free_blocks == stats.scheduler.num_total_blocks
    assert stats.scheduler.num_running == stats.scheduler.num_waiting == 0


@pytest.mark.parametrize("mode", MODES)
async def test_abort_mid_prefill_frees_every_block(llama_dir: Path, mode: str) -> None:
    """300-token prompts in 64-token chunks: when the first request has its first token, the
    second is part-way through its prompt and the rest wait; the odd half is abandoned then."""
    prompts = random_prompts([300] * 12, seed=5)
    first_token = trio.Event()
    abandoned: list[trio.CancelScope] = []
    finished: list[str] = []

    async def request(engine: Engine, i: int) -> None:
        with trio.CancelScope() as scope:
            if i % 2:
                abandoned.append(scope)
            params = SamplingParams(max_tokens=8, ignore_eos=True)  # "length", never an EOS
            async for out in engine.generate(prompts[i], params):
                first_token.set()
                if out.finished:
                    finished.append(out.finish_reason or "")

    async def abandon_the_odd_half() -> None:
        await first_token.wait()
        for scope in abandoned:
            scope.cancel()

    async with open_engine(config(llama_dir, mode, max_num_batched_tokens=64)) as engine:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(abandon_the_odd_half)
            for i in range(12):
                nursery.start_soon(request, engine, i)
        stats = await engine.fetch_statistics()
    assert finished == ["length"] * 6
    assert stats.scheduler.num_aborts == 6
    assert stats.scheduler.num_free_blocks == stats.scheduler.num_total_blocks


@pytest.mark.parametrize("mode", MODES)
async def test_cancelled_waiting_request_is_never_sent(llama_dir: Path, mode: str) -> None:
    async with open_engine(config(llama_dir, mode)) as engine:
        with trio.CancelScope() as scope:
            scope.cancel()  # cancelled before its first checkpoint
            await collect(engine, [1, 2, 3], SamplingParams(max_tokens=5))
        assert (await collect(engine, [1, 2, 3], SamplingParams(max_tokens=5)))["tokens"]
        stats = await engine.fetch_statistics()
    assert stats.scheduler.num_aborts == 0  # the add was dropped from the outbox instead


@pytest.mark.parametrize("mode", MODES)
async def test_seeded_sampling_is_the_same_alone_or_in_a_batch(llama_dir: Path, mode: str) -> None:
    seeded = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    prompt = random_prompts([20], seed=3)[0]
    others = random_prompts([3 + 11 * i for i in range(15)], seed=4)
    async with open_engine(config(llama_dir, mode)) as engine:
        alone = await collect(engine, prompt, seeded)
        batch = await collect_all(
            engine, [prompt, *others], SamplingParams(max_tokens=24, temperature=1.0)
        )
        seeded_in_batch = await collect_all(engine, [*others[:7], prompt, *others[7:]], seeded)
        unseeded = await collect_all(engine, [prompt] * 2, SamplingParams(max_tokens=24))
    assert seeded_in_batch[7]["tokens"] == alone["tokens"]
    assert batch[0]["tokens"] != alone["tokens"]  # a different seed draws differently
    assert unseeded[0]["tokens"] != unseeded[1]["tokens"]


@pytest.mark.parametrize("mode", MODES)
async def test_stop_conditions(llama_dir: Path, mode: str) -> None:
    async with open_engine(config(llama_dir, mode)) as engine:
        free = await collect(engine, [5, 6, 7], SamplingParams(max_tokens=30, temperature=0.0))
        stop_at = free["tokens"][3]
        first = free["tokens"].index(stop_at)
        stopped = await collect(
            engine,
            [5, 6, 7],
            SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=(stop_at,)),
        )
        # an unbounded request runs to the context limit
        to_limit = await collect(
            engine, [5] * 500, SamplingParams(temperature=0.0, ignore_eos=True)
        )
    assert stopped["tokens"] == free["tokens"][: first + 1]
    assert stopped["finish_reason"] == "stop"
    assert free["finish_reason"] == "length" and len(free["tokens"]) == 30
    assert len(to_limit["tokens"]) == 12 and to_limit["finish_reason"] == "length"
    assert all(lp <= 0.0 for lp in free["logprobs"])


@pytest.mark.parametrize("mode", MODES)
async def test_text_prompt_is_tokenized(llama_dir: Path, mode: str) -> None:
    async with open_engine(config(llama_dir, mode)) as engine:
        by_text = await collect(engine, "def hello():", SamplingParams(max_tokens=8, temperature=0))
        ids = engine.inputs.tokenizer.encode("def hello():")
        by_ids = await collect(engine, ids, SamplingParams(max_tokens=8, temperature=0))
    assert by_text["tokens"] == by_ids["tokens"]


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], SamplingParams(), "the prompt is empty"),
        ("", SamplingParams(), "the prompt is empty"),
        ([1, 2, 4096], SamplingParams(), "token ids must be ints in \\[0, 4096\\)"),
        ([1, -1], SamplingParams(), "token ids must be ints"),
        ([1] * 512, SamplingParams(), "the prompt has 512 tokens"),
        ([1] * 500, SamplingParams(max_tokens=13), "maximum context length is 512"),
    ],
)
async def test_bad_requests_raise_and_the_engine_keeps_serving(
    llama_dir: Path, prompt: object, params: SamplingParams, message: str
) -> None:
    async with open_engine(config(llama_dir, "inproc")) as engine:
        with pytest.raises(ValueError, match=message):
            await collect(engine, prompt, params)  # type: ignore[arg-type]
        assert (await collect(engine, [1, 2], SamplingParams(max_tokens=2)))["tokens"]


def test_bad_sampling_params_raise() -> None:
    for kwargs in (
        {"temperature": -1},
        {"top_p": 0},
        {"top_k": -2},
        {"min_p": 2},
        {"max_tokens": 0},
        {"stop": ("",)},
        {"temperature": float("nan")},
    ):
        with pytest.raises(ValueError):
            SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_more_than_two_steps_in_flight_is_refused() -> None:
    with pytest.raises(ValueError, match="max_steps_in_flight must be 1 or 2"):
        EngineConfig(model="m", max_steps_in_flight=3)


@pytest.mark.parametrize("mode", MODES)
async def test_duplicate_request_id_is_refused(llama_dir: Path, mode: str) -> None:
    async with open_engine(config(llama_dir, mode)) as engine:
        params = SamplingParams(max_tokens=200)
        stream = engine.generate([1, 2], params, rid="same")
        first = await anext(stream)
        with pytest.raises(ValueError, match="already in use"):
            await collect_rid(engine, "same")
        assert first.token_ids
        await stream.aclose()


async def collect_rid(engine: Engine, rid: str) -> None:
    async for _ in engine.generate([3], SamplingParams(max_tokens=2), rid=rid):
        pass


@pytest.mark.parametrize("mode", MODES)
async def test_health_and_statistics(llama_dir: Path, mode: str) -> None:
    async with open_engine(config(llama_dir, mode)) as engine:
        with trio.fail_after(5):
            await engine.check_health()
        # ignore_eos: at temperature 1 a random model may sample its EOS and end a request early
        params = SamplingParams(max_tokens=5, ignore_eos=True)
        await collect_all(engine, random_prompts([10] * 4), params)
        stats = await engine.fetch_statistics()
    assert stats.scheduler.num_generated_tokens == 20
    assert stats.worker.forward_seconds > 0 and stats.scheduler.num_steps >= 5


@pytest.mark.parametrize("mode", MODES)
async def test_stop_strings_end_the_request_at_the_match(llama_dir: Path, mode: str) -> None:
    greedy = SamplingParams(max_tokens=40, temperature=0.0)
    async with open_engine(config(llama_dir, mode)) as engine:
        free = await collect(engine, "The def statement", greedy)
        text = free["text"]
        stop = text[len(text) // 2 : len(text) // 2 + 3]  # three characters from the middle
        stopped = await collect(engine, "The def statement", greedy.replace(stop=(stop, "zzzz")))
        stats = await engine.fetch_statistics()
    assert stopped["text"] == text[: text.index(stop)]
    assert stopped["finish_reason"] == "stop" and stopped["matched_stop"] == stop
    assert len(stopped["tokens"]) < len(free["tokens"])
    assert stopped["tokens"] == free["tokens"][: len(stopped["tokens"])]
    assert stats.scheduler.num_aborts == 1  # the scheduler was told to stop generating
    assert stats.kv_cache_usage == 0.0


@pytest.mark.parametrize("mode", MODES)
async def test_stop_token_text_is_not_output(llama_dir: Path, mode: str) -> None:
    greedy = SamplingParams(max_tokens=20, temperature=0.0)
    async with open_engine(config(llama_dir, mode)) as engine:
        free = await collect(engine, "class Foo:", greedy)
        stop_id = free["tokens"][5]
        stopped = await collect(engine, "class Foo:", greedy.replace(stop_token_ids=(stop_id,)))
    first = free["tokens"].index(stop_id)
    assert stopped["tokens"] == free["tokens"][: first + 1]
    assert stopped["matched_stop"] == stop_id
    assert stopped["text"] == engine.inputs.tokenizer.decode(free["tokens"][:first])


@pytest.mark.parametrize("mode", MODES)
async def test_abort_by_id_ends_the_stream(llama_dir: Path, mode: str) -> None:
    async with open_engine(config(llama_dir, mode)) as engine:
        outputs = engine.generate([1, 2, 3], SamplingParams(max_tokens=400), rid="mine")
        first = await anext(outputs)
        engine.abort("mine")
        rest = [out async for out in outputs]
        stats = await engine.fetch_statistics()
    assert first.finish_reason is None
    assert rest[-1].finish_reason == "abort"
    assert stats.scheduler.num_aborts == 1 and stats.kv_cache_usage == 0.0
