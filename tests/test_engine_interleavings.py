"""Any interleaving of requests (reused ids, stop strings, disconnects, cancels, aborts) leaves
the engine serving, ends every request once, crosses no streams and frees every block.

The engine is the real frontend and scheduler actor with the model-free worker of
tests/fake_worker.py over in-memory links (so hypothesis can try hundreds of programs, each on
trio's autojump clock); the worker's tokens are known in advance, so any token that reaches the
wrong request shows.
"""

from __future__ import annotations

from contextlib import aclosing
from pathlib import Path

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.config.sampling import SamplingParams
from runtime.frontend.engine import Engine
from runtime.protocol import RequestTimeoutError
from tests.engine_helpers import NUM_BLOCKS, fake_engine
from tests.fake_worker import expected_output

LABELS = "abc"


# ("start", label, prompt, max_tokens, stop strings, how it ends, after how many outputs)
starts = st.tuples(
    st.just("start"),
    st.sampled_from(LABELS),
    st.lists(st.integers(3, 49), min_size=1, max_size=12),
    st.integers(1, 20),
    st.lists(st.sampled_from("ABC:;"), max_size=2),
    st.sampled_from(["read", "leave", "cancel"]),
    st.integers(0, 4),
)
programs = st.lists(
    st.one_of(
        starts,
        st.tuples(st.just("abort"), st.sampled_from(LABELS)),
        st.tuples(st.just("wait"), st.integers(0, 3)),
    ),
    max_size=25,
)


@settings(max_examples=150, deadline=None)
@given(program=programs, depth=st.sampled_from([1, 2]))
def test_no_interleaving_crashes_crosses_or_leaks(
    llama_dir: Path, program: list, depth: int
) -> None:
    trio.run(
        run_program, llama_dir, program, depth, clock=trio.testing.MockClock(autojump_threshold=0)
    )


async def run_program(model: Path, program: list, depth: int) -> None:
    outcomes: list[tuple[str, list[int], list[int]]] = []  # (how it ended, tokens, expected)
    async with fake_engine(model, depth) as engine:
        eos = engine.info.eos_token_ids
        with trio.fail_after(600):  # on the autojump clock: only a real hang gets here
            async with trio.open_nursery() as clients:
                for op in program:
                    if op[0] == "start":
                        clients.start_soon(one_request, engine, op, eos, outcomes)
                        await trio.lowlevel.checkpoint()
                    elif op[0] == "abort":
                        engine.abort(op[1])
                    else:
                        await trio.sleep(op[1])
            await trio.sleep(1)  # let the last aborts reach the scheduler
            stats = await engine.fetch_statistics()
            await engine.check_health()
    for ended, tokens, expected in outcomes:
        assert tokens == expected[: len(tokens)], "a request got tokens that are not its own"
        if ended in ("length", "stop") and "stop string" not in ended:
            assert ended != "length" or tokens == expected
    assert stats.frontend.num_requests_open == 0
    assert stats.scheduler.num_running == stats.scheduler.num_waiting == 0
    assert stats.scheduler.num_free_blocks == NUM_BLOCKS  # every block back


async def one_request(
    engine: Engine,
    op: tuple,
    eos: frozenset[int],
    outcomes: list[tuple[str, list[int], list[int]]],
) -> None:
    _, label, prompt, max_tokens, stops, how, after = op
    params = SamplingParams(max_tokens=max_tokens, stop=tuple(stops))
    expected = expected_output(prompt, max_tokens, eos)
    tokens: list[int] = []
    finishes: list[str] = []
    try:
        with trio.CancelScope() as scope:
            async with aclosing(engine.generate(prompt, params, rid=label)) as outputs:
                async for out in outputs:
                    tokens += out.token_ids
                    if out.finish_reason is not None:
                        finishes.append(out.finish_reason)
                    if how != "read" and len(tokens) >= after:
                        if how == "cancel":
                            scope.cancel()
                        break
    except ValueError as exc:  # its label belongs to a request still open: refused
        assert "by a request that has not ended" in str(exc) and not tokens
        return
    assert len(finishes) <= 1, "a request ended twice"
    if how == "read" and not scope.cancelled_caught:
        assert finishes, "a request read to its end never ended"
    outcomes.append((finishes[0] if finishes else how, tokens, expected))


async def test_a_request_past_its_timeout_ends_with_an_error(
    llama_dir: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """A hung worker (alive, not stepping) holds a request with a timeout no longer than it."""
    async with fake_engine(llama_dir, depth=2, hang_after=3) as engine:
        tokens: list[int] = []
        with pytest.raises(RequestTimeoutError, match="30 s timeout"):
            async for out in engine.generate([5, 6], SamplingParams(max_tokens=50), timeout=30):
                tokens += out.token_ids
        assert 0 < len(tokens) < 50
        assert engine.statistics().frontend.num_requests_open == 0  # its slot is free
        with pytest.raises(ValueError, match="timeout must be positive"):
            engine.generate([5], timeout=0)


async def test_a_hung_worker_is_named(
    llama_dir: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """Alive but not stepping: the health check times out, and the scheduler still answers."""
    async with fake_engine(llama_dir, depth=2, hang_after=1) as engine:
        with trio.move_on_after(5):
            async for _ in engine.generate([5, 6], SamplingParams(max_tokens=20)):
                pass
        with trio.move_on_after(5) as health:
            await engine.check_health()
        assert health.cancelled_caught
        assert await engine.diagnose() == "the worker is not answering (the scheduler is)"


async def test_output_already_made_is_handed_over_past_the_deadline(
    llama_dir: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """The timeout is for the engine's work: a slow reader still gets a finished output."""
    async with fake_engine(llama_dir, depth=2) as engine:
        outputs = engine.generate([5, 6], SamplingParams(max_tokens=5), timeout=30)
        async with aclosing(outputs):
            tokens = (await anext(outputs)).token_ids
            await trio.sleep(35)  # generation ended long ago; the reader comes back late
            tokens += [t async for out in outputs for t in out.token_ids]
        assert tokens == expected_output([5, 6], 5, engine.info.eos_token_ids)


async def test_a_stop_string_frees_the_engine_before_the_reader_comes_back(
    llama_dir: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with fake_engine(llama_dir, depth=2) as engine:
        prompt = [6, 6, 6, 6]
        stop = engine.tokenizer.decode([expected_output(prompt, 3)[2]])
        outputs = engine.generate(prompt, SamplingParams(max_tokens=40, stop=(stop,)))
        async with aclosing(outputs):
            async for out in outputs:
                if out.finished:
                    break  # the reader stalls here, its generator still open
            assert out.finish_reason == "stop"
            await trio.sleep(1)
            stats = await engine.fetch_statistics()
            assert stats.frontend.num_requests_open == 1
            assert stats.frontend.num_requests_generating == 0  # holds no slot
            assert stats.scheduler.num_running == stats.scheduler.num_waiting == 0
