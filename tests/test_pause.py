"""Pause and resume on the real engine (frontend and scheduler actor, model-free worker, trio's
autojump clock): each mode's promise, requests queued while paused, and misuse."""

from __future__ import annotations

from contextlib import aclosing
from pathlib import Path

import pytest
import trio
import trio.lowlevel
import trio.testing

from runtime.config.sampling import SamplingParams
from runtime.frontend.engine import Engine
from runtime.protocol import RequestOutput
from tests.engine_helpers import NUM_BLOCKS, fake_engine
from tests.fake_worker import expected_output

PROMPT = [5, 6, 7]
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


class Run:
    """One request, consumed in the background; its outputs so far, and whether it ended."""

    def __init__(self, engine: Engine, prompt: list[int], params: SamplingParams = GREEDY):
        self.outputs: list[RequestOutput] = []
        self.done = trio.Event()
        self.started = trio.Event()  # its first tokens came
        self._stream = engine.generate(prompt, params)

    async def consume(self) -> None:
        async with aclosing(self._stream) as outputs:
            async for out in outputs:
                self.outputs.append(out)
                if len(self.token_ids) >= 2:
                    self.started.set()
        self.done.set()

    @property
    def token_ids(self) -> list[int]:
        return [t for out in self.outputs for t in out.token_ids]

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[-1].finish_reason if self.outputs else None


async def started(nursery: trio.Nursery, run: Run) -> Run:
    nursery.start_soon(run.consume)
    await run.started.wait()
    return run


async def at_rest(engine: Engine) -> None:
    stats = (await engine.fetch_statistics()).scheduler
    assert (stats.num_running, stats.num_waiting, stats.num_free_blocks) == (0, 0, NUM_BLOCKS)


@pytest.mark.parametrize("depth", [1, 2])
async def test_keep_freezes_then_continues_with_the_same_tokens(
    llama_dir: Path, depth: int, autojump_clock: trio.testing.MockClock
) -> None:
    async with fake_engine(llama_dir, depth) as engine, trio.open_nursery() as nursery:
        run = await started(nursery, Run(engine, PROMPT))
        await engine.control.pause("keep")
        assert engine.control.is_paused
        frozen = len(run.token_ids)
        late = Run(engine, [9, 9])
        nursery.start_soon(late.consume)
        await trio.sleep(60)  # nothing moves while paused
        assert len(run.token_ids) == frozen and not late.outputs
        stats = (await engine.fetch_statistics()).scheduler
        assert stats.num_running == 1 and stats.num_free_blocks < NUM_BLOCKS  # KV kept
        await engine.control.resume()
        await run.done.wait()
        await late.done.wait()
        assert run.token_ids == expected_output(PROMPT, 40)
        assert late.token_ids == expected_output([9, 9], 40)
        assert not engine.control.is_paused
        await at_rest(engine)


async def test_abort_ends_everything_with_its_partial_output(
    llama_dir: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with fake_engine(llama_dir, 2) as engine, trio.open_nursery() as nursery:
        runs = [await started(nursery, Run(engine, [3 + i, 4])) for i in range(3)]
        waiting = Run(engine, [8, 8])  # beyond max_num_seqs 3: queued in the scheduler
        nursery.start_soon(waiting.consume)
        while engine.statistics().frontend.num_requests_open < 4:  # it is in the engine
            await trio.lowlevel.checkpoint()
        await engine.control.pause("abort")
        stats = (await engine.fetch_statistics()).scheduler
        assert (stats.num_running, stats.num_waiting) == (0, 0)
        assert stats.num_free_blocks == NUM_BLOCKS  # freed before pause returned
        for run in [*runs, waiting]:
            await run.done.wait()
            assert run.finish_reason == "abort"
        for i, run in enumerate(runs):
            assert 2 <= len(run.token_ids) < 40
            assert run.token_ids == expected_output([3 + i, 4], 40)[: len(run.token_ids)]
        after = Run(engine, PROMPT)  # arrives while paused: waits for resume
        nursery.start_soon(after.consume)
        await trio.sleep(30)
        assert not after.outputs
        await engine.control.resume()
        await after.done.wait()
        assert after.token_ids == expected_output(PROMPT, 40)
        await at_rest(engine)


async def test_wait_lets_open_requests_finish_and_holds_new_ones(
    llama_dir: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with fake_engine(llama_dir, 2) as engine, trio.open_nursery() as nursery:
        run = await started(nursery, Run(engine, PROMPT))
        pausing = trio.Event()

        async def pause() -> None:
            await engine.control.pause("wait")
            pausing.set()

        nursery.start_soon(pause)
        while not engine.control.is_paused:  # the pause has begun
            await trio.lowlevel.checkpoint()
        late = Run(engine, [9, 9])
        nursery.start_soon(late.consume)
        await pausing.wait()
        assert run.done.is_set() and run.finish_reason == "length"
        assert run.token_ids == expected_output(PROMPT, 40)
        await trio.sleep(30)
        assert not late.outputs
        await engine.control.resume()
        await late.done.wait()
        assert late.token_ids == expected_output([9, 9], 40)


async def test_a_request_that_leaves_while_queued_is_aborted_cleanly(
    llama_dir: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with fake_engine(llama_dir, 2) as engine, trio.open_nursery() as nursery:
        await engine.control.pause("keep")
        with trio.move_on_after(5):
            await Run(engine, PROMPT).consume()  # cancelled while held
        await engine.control.resume()
        await at_rest(engine)
        assert engine.statistics().frontend.num_requests_open == 0
        nursery.cancel_scope.cancel()


async def test_misuse_is_a_clear_error(llama_dir: Path) -> None:
    async with fake_engine(llama_dir, 2) as engine:
        await engine.control.resume()  # not paused: a no-op
        with pytest.raises(ValueError, match="mode must be one of abort, wait, keep, retract"):
            await engine.control.pause("sleep")
        assert not engine.control.is_paused
        assert await engine.control.pause("keep") is True
        assert await engine.control.pause("abort") is False  # already paused: nothing changes
        await engine.control.resume()
        await engine.control.resume()
        assert not engine.control.is_paused


async def test_flush_cache_is_refused_while_requests_are_open(
    llama_dir: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with fake_engine(llama_dir, 2) as engine, trio.open_nursery() as nursery:
        first = Run(engine, PROMPT)
        await first.consume()
        second = Run(engine, PROMPT)  # the same prompt: its prefix is cached
        await second.consume()
        assert second.outputs[-1].num_cached_tokens > 0 or len(PROMPT) < 5
        await engine.control.pause("keep")
        held = Run(engine, PROMPT)
        nursery.start_soon(held.consume)
        while engine.statistics().frontend.num_requests_open < 1:
            await trio.lowlevel.checkpoint()
        await engine.fetch_statistics()  # the held request reached the scheduler
        with pytest.raises(ValueError, match="0 running, 0 waiting, 1 held by a pause"):
            await engine.control.flush_cache()
        await engine.control.resume()
        await held.done.wait()
        await engine.control.flush_cache()
        await at_rest(engine)


async def test_an_update_lets_open_requests_finish_then_serves_the_new_weights(
    llama_dir: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with fake_engine(llama_dir, 2) as engine, trio.open_nursery() as nursery:
        old = await started(nursery, Run(engine, PROMPT))
        answers = []
        updated = trio.Event()

        async def update() -> None:
            answers.append(
                await engine.weights.update_weights_from_disk("new", weight_version="v2")
            )
            updated.set()

        nursery.start_soon(update)
        while not engine.control.is_paused:  # the update has begun: it pauses first
            await trio.lowlevel.checkpoint()
        new = Run(engine, [9, 9])  # arrives during the update: waits for it
        await new.consume()
        await updated.wait()
        assert answers == [(True, "Succeeded to update model weights.", 1)]
        assert old.token_ids == expected_output(PROMPT, 40)  # finished on the old weights
        assert new.token_ids == expected_output([9, 9], 40, weights=1)
        assert engine.model_card.weight_version == "v2" and engine.model_card.path == "new"
        assert not engine.control.is_paused
        await at_rest(engine)


async def test_a_failed_update_changes_nothing(
    llama_dir: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with fake_engine(llama_dir, 2) as engine:
        success, message, _ = await engine.weights.update_weights_from_disk(
            "bad", weight_version="v2"
        )
        assert not success and "no such checkpoint" in message
        run = Run(engine, PROMPT)
        await run.consume()
        assert run.token_ids == expected_output(PROMPT, 40)
        assert engine.model_card.weight_version == "default" and not engine.control.is_paused


async def test_an_update_while_paused_proceeds_at_once_and_stays_paused(
    llama_dir: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with fake_engine(llama_dir, 2) as engine, trio.open_nursery() as nursery:
        run = await started(nursery, Run(engine, PROMPT))
        await engine.control.pause("keep")
        done = len(run.token_ids)
        assert (await engine.weights.update_weights_from_disk("new"))[0]
        assert engine.control.is_paused
        await engine.control.resume()
        await run.done.wait()
        assert run.token_ids[:done] == expected_output(PROMPT, 40)[:done]
        assert run.token_ids != expected_output(PROMPT, 40)  # the rest: the new weights


async def test_a_resume_during_a_memory_release_waits_for_it_then_is_refused(
    llama_dir: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """Found by review: the resume used to slip in and let steps run without their memory."""
    async with fake_engine(llama_dir, 2) as engine, trio.open_nursery() as nursery:
        nursery.start_soon(engine.control.release_memory_occupation, None)
        while not engine.control.is_paused:  # the release has begun
            await trio.lowlevel.checkpoint()
        with pytest.raises(ValueError, match="resume_memory_occupation first"):
            await engine.control.resume()
        assert engine.control.is_sleeping and engine.control.is_paused
        run = Run(engine, PROMPT)
        nursery.start_soon(run.consume)
        await trio.sleep(30)
        assert not run.outputs  # held while the memory is away
        await engine.control.resume_memory_occupation()
        await run.done.wait()
        assert run.token_ids == expected_output(PROMPT, 40) and not engine.control.is_paused
