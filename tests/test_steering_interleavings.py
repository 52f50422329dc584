"""Any interleaving of requests (read to the end, left, cancelled) with every steering call
(pause in each mode, resume, weight updates good and bad, cache flush, memory release and
resume, abort of everything) ends: no deadlock, every request ends once with a valid reason,
no block leaked, no call left waiting.

The real frontend and scheduler actor with the model-free worker, on trio's autojump clock; a
steering call the engine's state forbids (a second pause, a flush while requests run) is a
ValueError, which is an answer, not a failure.
"""

from __future__ import annotations

import contextlib
import functools
from contextlib import aclosing
from pathlib import Path

import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.config.sampling import SamplingParams
from runtime.frontend.engine import Engine
from tests.engine_helpers import NUM_BLOCKS, fake_engine

# Virtual seconds in which everything must have ended once the program is over.
BOUND = 1000.0

steering = st.one_of(
    st.tuples(st.just("pause"), st.sampled_from(["abort", "wait", "keep"])),
    st.tuples(st.just("resume")),
    st.tuples(st.just("update"), st.sampled_from(["new", "bad"])),
    st.tuples(st.just("flush")),
    st.tuples(st.just("release"), st.sampled_from([["kv_cache"], ["weights"], None])),
    st.tuples(st.just("resume_memory")),
    st.tuples(st.just("abort_all")),
)
requests = st.tuples(
    st.just("start"),
    st.lists(st.integers(3, 49), min_size=1, max_size=10),
    st.integers(1, 16),
    st.sampled_from(["read", "leave", "cancel"]),
    st.integers(0, 4),
)
programs = st.lists(
    st.one_of(requests, steering, st.tuples(st.just("wait"), st.integers(0, 3))), max_size=25
)


@settings(max_examples=120, deadline=None)
@given(program=programs, depth=st.sampled_from([1, 2]))
def test_no_interleaving_of_steering_deadlocks_or_leaks(
    llama_dir: Path, program: list, depth: int
) -> None:
    clock = trio.testing.MockClock(autojump_threshold=0)
    trio.run(run_program, llama_dir, program, depth, clock=clock)


async def run_program(model: Path, program: list, depth: int) -> None:
    ended: list[str | None] = []  # each request's finish reason (None: left or cancelled)
    async with fake_engine(model, depth) as engine:
        with trio.fail_after(BOUND):
            async with trio.open_nursery() as nursery:
                for op in program:
                    if op[0] == "start":
                        nursery.start_soon(request, engine, op, ended)
                    elif op[0] == "wait":
                        await trio.sleep(op[1])
                    else:
                        nursery.start_soon(steer, engine, op)
                    await trio.lowlevel.checkpoint()
                await trio.sleep(BOUND / 10)  # let the program's calls play out
                await engine.control.resume_memory_occupation()  # then wake everything up
                await steer(engine, ("resume",))
        num_started = sum(op[0] == "start" for op in program)
        assert len(ended) == num_started  # every request ended, once
        assert all(reason in (None, "stop", "length", "abort") for reason in ended)
        assert not engine.control.is_paused and not engine.control.is_sleeping
        stats = (await engine.fetch_statistics()).scheduler
        assert (stats.num_running, stats.num_waiting) == (0, 0)
        assert stats.num_free_blocks == NUM_BLOCKS
        assert engine.statistics().frontend.num_requests_open == 0


async def request(engine: Engine, op: tuple, ended: list[str | None]) -> None:
    _, prompt, max_tokens, how, after = op
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    reason: str | None = None
    with trio.CancelScope() as scope:
        async with aclosing(engine.generate(prompt, params)) as outputs:
            count = 0
            async for out in outputs:
                reason = out.finish_reason
                count += 1
                if how == "cancel" and count > after:
                    scope.cancel()
                if how == "leave" and count > after:
                    break
    ended.append(reason if how == "read" or reason is not None else None)


async def steer(engine: Engine, op: tuple) -> None:
    calls = {
        "pause": lambda: engine.control.pause(op[1]),
        "resume": engine.control.resume,
        "update": lambda: engine.weights.update_weights_from_disk(op[1]),
        "flush": engine.control.flush_cache,
        "release": lambda: engine.control.release_memory_occupation(op[1]),
        "resume_memory": engine.control.resume_memory_occupation,
        "abort_all": functools.partial(_abort_all, engine),
    }
    with contextlib.suppress(ValueError):  # the engine's state forbade it, and said so
        await calls[op[0]]()


async def _abort_all(engine: Engine) -> None:
    engine.abort_all()
    await trio.lowlevel.checkpoint()
