from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from runtime.config.pooling import PoolingParams
from runtime.config.sampling import SamplingParams
from runtime.scheduler.block_manager import BlockManager
from runtime.scheduler.sequence import Sequence
from tests.core_harness import EOS, CoreHarness


@pytest.mark.parametrize("depth", [1, 2])
def test_decodes_every_request_to_its_length(depth: int) -> None:
    h = CoreHarness(depth=depth)
    for i in range(5):
        h.add(f"r{i}", [1 + i] * (3 + 7 * i), max_tokens=4 + i)
    h.run_until_idle()
    assert h.finished == {f"r{i}": "length" for i in range(5)}
    assert [len(h.outputs[f"r{i}"]) for i in range(5)] == [4, 5, 6, 7, 8]


def test_long_prompt_is_chunked_within_the_token_budget() -> None:
    h = CoreHarness(max_num_batched_tokens=8, max_model_len=64)
    h.add("long", list(range(1, 30)), max_tokens=2)
    assert [h.step().num_tokens for _ in range(4)] == [[8], [8], [8], [5]]
    assert len(h.outputs["long"]) == 1  # only the last chunk samples
    h.run_until_idle()
    assert len(h.outputs["long"]) == 2


@pytest.mark.parametrize("depth", [1, 2])
def test_eos_stops_unless_ignored(depth: int) -> None:
    h = CoreHarness(depth=depth)
    h.add("a", [5, 6, 7], max_tokens=40, ignore_eos=False)
    h.add("b", [5, 6, 7], max_tokens=40, ignore_eos=True)
    h.run_until_idle()
    assert h.outputs["a"][-1].token_id == EOS and h.finished["a"] == "stop"
    assert len(h.outputs["b"]) == 40 and h.finished["b"] == "length"


@pytest.mark.parametrize("depth", [1, 2])
def test_shared_prefix_hits_the_cache_and_verifies_tokens(depth: int) -> None:
    h = CoreHarness(block_size=4, depth=depth)
    prompt = list(range(1, 14))  # 13 tokens: 3 full blocks may be shared
    h.add("first", prompt, max_tokens=1)
    h.run_until_idle()
    h.add("second", prompt, max_tokens=1)
    h.add("other", [9] * 13, max_tokens=1)
    h.run_until_idle()
    assert h.outputs["second"][0].num_cached_tokens == 12
    assert h.outputs["other"][0].num_cached_tokens == 0


def test_a_block_is_reused_only_under_the_same_whole_prefix() -> None:
    """B's second block holds the same tokens as A's but follows another first block: its
    KV differs, so C (A's prompt again) must get A's blocks, never B's."""
    bm = BlockManager(num_blocks=8, block_size=2)
    params = SamplingParams(max_tokens=1)

    def computed(seq_id: int, tokens: list[int]) -> Sequence:
        seq = Sequence(seq_id, str(seq_id), tokens, params, max_tokens=1)
        bm.allocate(seq, bm.blocks_needed(seq, len(tokens)))
        bm.cache_full_blocks(seq, 0, len(tokens))
        seq.num_computed_tokens = len(tokens)
        return seq

    a = computed(0, [1, 2, 3, 4, 9])
    b = computed(1, [5, 6, 3, 4, 9])
    assert (
        bm.match_prefix(Sequence(2, "c", [1, 2, 3, 4, 9], params, max_tokens=1))
        == a.block_table[:2]
    )
    assert (
        bm.match_prefix(Sequence(3, "d", [5, 6, 3, 4, 9], params, max_tokens=1))
        == b.block_table[:2]
    )


def test_cache_never_covers_the_last_token() -> None:
    h = CoreHarness(block_size=4)
    h.add("first", list(range(1, 9)), max_tokens=1)  # exactly two blocks
    h.run_until_idle()
    h.add("again", list(range(1, 9)), max_tokens=1)
    h.run_until_idle()
    assert h.outputs["again"][0].num_cached_tokens == 4


@pytest.mark.parametrize("depth", [1, 2])
def test_pool_exhaustion_preempts_and_everyone_still_finishes(depth: int) -> None:
    h = CoreHarness(
        num_blocks=8, block_size=4, max_model_len=32, max_num_batched_tokens=64, depth=depth
    )
    for i in range(6):
        h.add(f"r{i}", [i + 1] * 5, max_tokens=20)
    h.run_until_idle()
    assert h.sched.num_preemptions > 0
    assert all(reason == "length" for reason in h.finished.values())
    assert all(len(h.outputs[f"r{i}"]) == 20 for i in range(6))


def test_abort_waiting_running_and_in_flight() -> None:
    h = CoreHarness(max_num_seqs=2)
    for rid in "abcd":
        h.add(rid, [1, 2, 3], max_tokens=10)
    h.step()
    h.abort("c")  # waiting
    h.step(abort_in_flight=("a",))  # running, its step already sent to the worker
    h.abort("b")
    h.abort("b")  # twice is a no-op
    h.run_until_idle()
    assert h.finished == {"a": "abort", "b": "abort", "c": "abort", "d": "length"}


def test_rejects_duplicate_rid_and_too_long_requests() -> None:
    h = CoreHarness(max_model_len=16)
    h.add("a", [1, 2], max_tokens=4)
    with pytest.raises(ValueError, match="already in use"):
        h.add("a", [1], max_tokens=1)
    with pytest.raises(ValueError, match="max_model_len"):
        h.add("b", [1] * 10, max_tokens=7)


@pytest.mark.parametrize("depth", [1, 2])
def test_abort_100_of_200_leaves_every_block_free(depth: int) -> None:
    h = CoreHarness(num_blocks=64, block_size=4, max_num_seqs=32, max_model_len=64, depth=depth)
    for i in range(200):
        h.add(f"r{i}", [1 + i % 7] * (2 + i % 13), max_tokens=8 + i % 5)
    for _ in range(3):
        h.step()
    for i in range(0, 200, 2):
        h.abort(f"r{i}")
    h.run_until_idle()
    assert sum(reason == "abort" for reason in h.finished.values()) == 100
    assert h.bm.num_free_blocks == h.bm.num_blocks


# -- property test: any interleaving of add / step / abort / finish ------------------------------

prompts = st.lists(st.integers(1, 3), min_size=1, max_size=20)  # few distinct tokens: many hits
operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), prompts, st.integers(1, 12), st.booleans()),
        st.tuples(st.just("step"), st.lists(st.integers(0, 40), max_size=2)),
        st.tuples(st.just("abort"), st.integers(0, 40)),
        st.tuples(st.just("fork"), st.integers(1, 3)),  # samples of the last request added
        st.tuples(st.just("pause"), st.sampled_from(["keep", "wait", "retract"])),
        st.tuples(st.just("resume")),
        st.tuples(st.just("embed"), prompts, st.sampled_from(["last", "mean"])),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
# a sequence preempted (or retracted) ahead of waiting forks that hold their sibling's prompt:
# it once preempted itself forever rather than let the fork at the queue's head unshare
@example(
    ops=[("add", [3, 2, 1, 1, 1, 3, 2, 2], 1, False), ("fork", 2),
         ("add", [1, 3, 2, 3, 1, 3, 1], 10, True), ("pause", "keep"), ("fork", 1), ("resume",),
         ("fork", 3), ("fork", 3), ("step", []), ("step", [20, 33]), ("step", [7, 5]),
         ("add", [1, 3, 2, 3, 2, 3, 2, 1, 2, 2, 3, 2, 2, 3], 3, True), ("step", [3, 34]),
         ("fork", 3), ("add", [1, 2, 2, 1, 1, 1, 2, 2, 3, 1, 2, 2], 4, True),
         ("pause", "retract"), ("resume",), ("step", [34, 35]), ("step", [6]), ("fork", 1),
         ("add", [2, 3, 2, 1, 3, 3, 2, 1, 3, 3, 3, 1, 3, 2, 2], 2, True), ("pause", "retract"),
         ("pause", "keep"), ("abort", 6), ("add", [2, 3, 3, 2, 1], 3, False)],
    num_blocks=17, block_size=1, budget=1, max_num_seqs=5, prefix_caching=True, depth=2,
)  # fmt: skip
@given(
    ops=operations,
    num_blocks=st.integers(8, 24),
    block_size=st.sampled_from([1, 2, 4]),
    budget=st.integers(1, 24),
    max_num_seqs=st.integers(1, 6),
    prefix_caching=st.booleans(),
    depth=st.sampled_from([1, 2]),
)
def test_no_interleaving_leaks_or_double_frees_a_block(
    ops: list,
    num_blocks: int,
    block_size: int,
    budget: int,
    max_num_seqs: int,
    prefix_caching: bool,
    depth: int,
) -> None:
    h = CoreHarness(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=min(32, num_blocks * block_size),
        prefix_caching=prefix_caching,
        depth=depth,
    )
    added = 0
    last: tuple | None = None
    for op in ops:
        if op[0] == "add":
            _, prompt, max_tokens, ignore_eos = op
            max_tokens = min(max_tokens, h.sched.max_model_len - len(prompt))
            if max_tokens >= 1:
                last = (f"r{added}", prompt, max_tokens, ignore_eos)
                h.add(*last)
                added += 1
        elif op[0] == "fork":
            for _ in range(op[1] if last is not None else 0):
                h.add(f"r{added}", *last[1:], fork_of=last[0])
                added += 1
        elif op[0] == "step":
            h.step(abort_in_flight=tuple(f"r{i}" for i in op[1]))
        elif op[0] == "pause":
            h.sched.pause(op[1])
        elif op[0] == "resume":
            h.sched.resume()
        elif op[0] == "embed" and len(op[1]) <= h.sched.max_model_len:
            last = None  # nothing forks off an embedding
            h.add(f"r{added}", op[1], 1, pooling=PoolingParams(op[2]))
            added += 1
        else:
            h.abort(f"r{op[1]}")
        h.check_invariants()
    h.run_until_idle()
    if h.sched.pause_mode != "keep":  # a "wait" pause runs what it admitted to its end
        assert not h.sched.running and not h.sched.waiting
    h.sched.resume()
    h.run_until_idle()
    assert set(h.finished) == set(h.outputs)  # every request ended, exactly once
    assert h.bm.num_free_blocks == h.bm.num_blocks


@pytest.mark.parametrize("depth", [1, 2])
def test_a_keep_pause_freezes_everything_and_resume_continues_exactly(depth: int) -> None:
    """The same steps in the same order, only later: the same tokens."""

    def run(pause_at: int | None) -> dict[str, list[int]]:
        h = CoreHarness(depth=depth, max_num_batched_tokens=8)
        for i in range(3):
            h.add(f"r{i}", [1, 2, 3, i + 1], max_tokens=6)
        for turn in range(200):
            if turn == pause_at:
                h.sched.pause("keep")
                for _ in range(5):
                    h.step()  # retires what was in flight, then nothing
                assert not h.pipeline.in_flight and h.pipeline.schedule_next() is None
                running = [(s.rid, list(s.block_table)) for s in h.sched.running]
                for _ in range(5):
                    h.step()
                assert [(s.rid, list(s.block_table)) for s in h.sched.running] == running
                h.sched.resume()
            if h.pipeline.idle:
                break
            h.step()
        return {rid: [o.token_id for o in outs] for rid, outs in h.outputs.items()}

    assert run(pause_at=3) == run(pause_at=None)


def test_arrivals_during_a_keep_pause_wait_behind_the_waiting() -> None:
    h = CoreHarness(max_num_seqs=1)
    h.add("first", [1], max_tokens=2)
    h.add("second", [2], max_tokens=2)
    h.step()
    h.sched.pause("keep")
    h.add("third", [3], max_tokens=2)
    assert h.pipeline.idle and [s.rid for s in h.sched.held] == ["third"]
    h.sched.resume()
    assert [s.rid for s in h.sched.waiting] == ["second", "third"]
    h.run_until_idle()
    assert set(h.finished) == {"first", "second", "third"}


def test_a_wait_pause_finishes_the_admitted_and_holds_arrivals() -> None:
    h = CoreHarness()
    h.add("early", [1, 2], max_tokens=4)
    h.sched.pause("wait")
    h.add("late", [1, 2], max_tokens=4)
    h.run_until_idle()
    assert h.finished == {"early": "length"} and h.sched.drained
    h.abort("late")  # a held request can leave before it ever ran
    assert h.finished["late"] == "abort" and not h.sched.held
    h.sched.resume()
    h.run_until_idle()
    assert h.bm.num_free_blocks == h.bm.num_blocks


def test_flush_cache_forgets_every_prefix_and_refuses_while_requests_are_open() -> None:
    h = CoreHarness(block_size=2)
    h.add("a", [1, 2, 3, 4, 5], max_tokens=2)
    h.run_until_idle()
    h.add("b", [1, 2, 3, 4, 5], max_tokens=2)
    with pytest.raises(ValueError, match="0 running, 1 waiting, 0 held"):
        h.sched.flush_cache()
    h.run_until_idle()
    assert h.sched.num_cached_tokens == 4  # b reused a's prefix
    assert h.sched.flush_cache() > 0 and not h.bm.cached
    h.add("c", [1, 2, 3, 4, 5], max_tokens=2)
    h.run_until_idle()
    assert h.sched.num_cached_tokens == 4  # nothing more was reused
    h.check_invariants()


# -- property test: request ids reused, while live (refused) or once ended (fine) ----------------


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("add"), st.integers(0, 4), prompts, st.integers(1, 8)),
            st.tuples(st.just("step"), st.lists(st.integers(0, 4), max_size=2)),
            st.tuples(st.just("abort"), st.integers(0, 4)),
        ),
        max_size=60,
    ),
    depth=st.sampled_from([1, 2]),
)
def test_reused_ids_never_corrupt_the_core(ops: list, depth: int) -> None:
    """A live id is refused with ValueError and changes nothing; an ended one can be reused at
    once, even while a step computed for its old request is still in flight."""
    h = CoreHarness(num_blocks=16, block_size=2, max_num_batched_tokens=8, depth=depth)
    accepted = 0
    for op in ops:
        if op[0] == "add":
            _, k, prompt, max_tokens = op
            rid = f"r{k}"
            if rid in h.sched.by_rid:
                with pytest.raises(ValueError, match="already in use"):
                    h.add(rid, prompt, max_tokens)
            else:
                h.add(rid, prompt, max_tokens)
                accepted += 1
        elif op[0] == "step":
            h.step(abort_in_flight=tuple(f"r{k}" for k in op[1]))
        else:
            h.abort(f"r{op[1]}")
        h.check_invariants()
    h.run_until_idle()
    assert set(h.finished) == set(h.outputs) and accepted >= len(h.finished)
    assert h.bm.num_free_blocks == h.bm.num_blocks


def test_forks_share_the_prompt_and_let_go_after_a_weight_update() -> None:
    h = CoreHarness(block_size=4, num_blocks=16)
    prompt = list(range(1, 11))  # two full blocks shared, the third recomputed
    h.add("a", prompt, max_tokens=3)
    h.add("a.1", prompt, max_tokens=3, fork_of="a")
    h.add("a.2", prompt, max_tokens=3, fork_of="a")
    assert [s.rid for s in h.sched.waiting] == ["a"]  # the samples wait for its prompt
    h.step()
    forks = [h.sched.by_rid["a.1"], h.sched.by_rid["a.2"]]
    parent = h.sched.by_rid["a"]
    assert [f.block_table for f in forks] == [parent.block_table[:2]] * 2
    assert h.bm.blocks[parent.block_table[0]].ref_count == 3
    h.sched.flush_cache(allow_open=True)  # new weights: the forks compute the prompt again
    assert [f.block_table for f in forks] == [[], []]
    h.run_until_idle()
    assert set(h.finished) == {"a", "a.1", "a.2"}
    assert h.bm.num_free_blocks == h.bm.num_blocks


@pytest.mark.parametrize("depth", [1, 2])
def test_a_retract_pause_frees_the_running_kv_and_resume_finishes_them(depth: int) -> None:
    h = CoreHarness(depth=depth, block_size=2, max_num_batched_tokens=8)
    for i in range(3):
        h.add(f"r{i}", [1, 2, 3, i + 1], max_tokens=6)
    for _ in range(3):
        h.step()
    running = [s.rid for s in h.sched.running]
    h.sched.pause("retract")
    for _ in range(4):
        h.step()  # retires what was in flight, then nothing
    assert not h.sched.running and not h.pipeline.in_flight
    assert [s.rid for s in h.sched.waiting][: len(running)] == running  # in their order
    assert all(not s.block_table for s in h.sched.waiting)
    h.sched.resume()
    h.run_until_idle()
    assert all(h.finished[rid] == "length" and len(h.outputs[rid]) == 6 for rid in h.outputs)
    assert h.bm.num_free_blocks == h.bm.num_blocks
