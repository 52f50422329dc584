"""n > 1: the samples of one request share its prompt's KV, draw from their own seeds, and are
aborted together."""

from __future__ import annotations

from contextlib import aclosing
from pathlib import Path

import pytest

from runtime.config.engine import EngineConfig
from runtime.config.sampling import SamplingParams
from runtime.frontend.launch import open_engine
from runtime.protocol import SessionParams
from tests.engine_helpers import collect, consume_samples, random_prompts

PROMPT = random_prompts([200], seed=5)[0]  # 13 blocks of 16; 12 shared
NUM_BLOCKS = 40  # 8 unshared copies of the prompt would need 104


def config(llama_dir: Path, **changes: object) -> EngineConfig:
    return EngineConfig(
        model=str(llama_dir),
        mode="inproc",
        dtype="float32",
        max_model_len=256,
        num_kv_blocks=NUM_BLOCKS,
        enable_prefix_caching=False,  # what is shared is shared by the fork alone
    ).replace(**changes)


async def test_samples_share_the_prompt_blocks_and_follow_their_seeds(llama_dir: Path) -> None:
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=11, n=8, ignore_eos=True)
    async with open_engine(config(llama_dir)) as engine:
        samples = await consume_samples(engine.generate(PROMPT, params))
        again = await consume_samples(engine.generate(PROMPT, params))
        alone = [await collect(engine, PROMPT, params.replace(n=1, seed=11 + i)) for i in (0, 3, 7)]
        stats = await engine.fetch_statistics()
    tokens = [s["tokens"] for s in samples]
    assert len(tokens) == 8 and len({tuple(t) for t in tokens}) == 8
    assert [s["tokens"] for s in again] == tokens  # a seed reproduces every sample
    assert [a["tokens"] for a in alone] == [tokens[0], tokens[3], tokens[7]]
    # sample 0 computed the prompt; the others got its 12 full blocks without computing them
    assert [s["num_cached_tokens"] for s in samples] == [0] + [192] * 7
    assert stats.scheduler.num_preemptions == 0  # unshared, 8 prompts would not fit
    assert stats.scheduler.num_free_blocks == NUM_BLOCKS


async def test_greedy_samples_are_identical(llama_dir: Path) -> None:
    params = SamplingParams(max_tokens=6, temperature=0.0, n=3)
    async with open_engine(config(llama_dir)) as engine:
        samples = await consume_samples(engine.generate(PROMPT[:40], params))
        single = await collect(engine, PROMPT[:40], params.replace(n=1))
    assert [s["tokens"] for s in samples] == [single["tokens"]] * 3


async def test_leaving_a_request_aborts_each_sample_exactly_once(llama_dir: Path) -> None:
    params = SamplingParams(max_tokens=200, n=4, ignore_eos=True, logprobs=2)
    async with open_engine(config(llama_dir, max_model_len=512)) as engine:
        async with aclosing(engine.generate(PROMPT[:30], params)) as outputs:
            seen = set()
            async for out in outputs:
                seen.add(out.index)
                if len(seen) == 4:
                    break
        stats = await engine.fetch_statistics()
        assert stats.frontend.num_requests_open == 0
        assert stats.scheduler.num_aborts == 4
        assert stats.scheduler.num_running == stats.scheduler.num_waiting == 0
        assert stats.scheduler.num_free_blocks == NUM_BLOCKS


async def test_limits_on_n_and_logprobs_are_clear_errors(llama_dir: Path) -> None:
    async with open_engine(config(llama_dir, max_n=4)) as engine:
        with pytest.raises(ValueError, match="n must be at most 4"):
            engine.generate(PROMPT[:5], SamplingParams(n=5))
        with pytest.raises(ValueError, match="logprobs must be at most 20"):
            engine.generate(PROMPT[:5], SamplingParams(logprobs=21))
        with pytest.raises(ValueError, match="logit_bias: token ids must be below"):
            engine.generate(PROMPT[:5], SamplingParams(logit_bias=((10**6, 1.0),)))
        with pytest.raises(ValueError, match="prompt has 5 tokens"):
            engine.generate(PROMPT[:5], SamplingParams(prompt_logprobs=1, prompt_logprobs_start=5))
        with pytest.raises(ValueError, match="also a bad word"):
            engine.generate(
                PROMPT[:5], SamplingParams(allowed_token_ids=(9,), bad_words_token_ids=((9,),))
            )
        session = SessionParams(engine.open_session(1000))
        with pytest.raises(ValueError, match="not available in a session turn"):
            engine.generate(PROMPT[:5], SamplingParams(prompt_logprobs=0), session=session)
        with pytest.raises(ValueError, match="a session turn takes n=1"):
            engine.generate(PROMPT[:5], SamplingParams(n=2), session=session)


async def test_a_sample_ended_by_a_stop_string_ends_once(llama_dir: Path) -> None:
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=11, n=4, stop=("e",))
    async with open_engine(config(llama_dir)) as engine:
        ends: dict[int, list] = {}
        async for out in engine.generate(PROMPT[:20], params):
            if out.finished:
                ends.setdefault(out.index, []).append((out.finish_reason, out.matched_stop))
    assert sorted(ends) == [0, 1, 2, 3]
    assert all(len(e) == 1 for e in ends.values()), ends
    assert sum(e == [("stop", "e")] for e in ends.values()) >= 2, ends  # "e" is common
