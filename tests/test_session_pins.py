"""The scheduler's side of sessions: a finished turn's cached KV stays pinned for the next
turn, until the session closes, the cache is flushed, or live requests need the blocks."""

from __future__ import annotations

from tests.core_harness import CoreHarness

HISTORY = list(range(1, 19))  # 18 tokens: 4 full blocks of 4 once 2 more are generated


def finished_turn(h: CoreHarness, session: str = "s") -> list[int]:
    """Run one turn of `session`; the whole history (prompt and output) it leaves."""
    h.add("t1", HISTORY, max_tokens=3, session=session)
    h.run_until_idle()
    return HISTORY + [t.token_id for t in h.outputs["t1"]]


def test_the_next_turn_finds_the_whole_history_cached() -> None:
    h = CoreHarness(num_blocks=32, block_size=4)
    h.sched.pins.open.add("s")
    history = finished_turn(h)  # 21 tokens: 5 full blocks computed (the last token's KV not)
    assert h.bm.num_free_blocks == 32 - 5  # pinned, though nothing runs
    for i in range(40):  # other prompts churn through the free blocks meanwhile
        h.add(f"other{i}", [30 + i % 20] * 9, max_tokens=2)
    h.run_until_idle()
    h.add("t2", [*history, 40, 41], max_tokens=2, session="s")
    h.run_until_idle()
    assert h.outputs["t2"][0].num_cached_tokens == 20


def test_close_releases_and_a_closed_session_pins_nothing() -> None:
    h = CoreHarness(num_blocks=32, block_size=4)
    h.sched.pins.open.add("s")
    finished_turn(h)
    h.sched.pins.close("s")
    assert h.bm.num_free_blocks == 32
    finished_turn(h)  # the session is closed: nothing kept
    assert h.bm.num_free_blocks == 32
    finished_turn(h, session="never-opened")
    assert h.bm.num_free_blocks == 32


def test_closing_never_frees_a_running_turns_blocks() -> None:
    h = CoreHarness(num_blocks=32, block_size=4)
    h.sched.pins.open.add("s")
    history = finished_turn(h)
    h.add("t2", [*history, 40], max_tokens=6, session="s")
    h.step()
    h.step()
    h.sched.pins.close("s")  # mid-turn: the harness checks every block's references
    h.run_until_idle()
    assert len(h.outputs["t2"]) == 6 and h.finished["t2"] == "length"
    assert h.bm.num_free_blocks == 32


def test_live_requests_take_an_idle_sessions_blocks_before_preempting() -> None:
    h = CoreHarness(num_blocks=8, block_size=4, max_model_len=32)
    h.sched.pins.open.add("s")
    finished_turn(h)  # 5 of 8 blocks pinned
    h.add("big", list(range(30, 54)), max_tokens=4)  # needs 7 blocks
    h.run_until_idle()
    assert h.finished["big"] == "length" and h.sched.num_preemptions == 0
    assert h.sched.pins.num_pinned_turns == 0


def test_a_flush_releases_every_pin() -> None:
    h = CoreHarness(num_blocks=32, block_size=4)
    h.sched.pins.open.add("s")
    finished_turn(h)
    h.sched.flush_cache()
    assert h.bm.num_free_blocks == 32 and h.sched.pins.num_pinned_turns == 0


def test_released_turns_go_and_others_stay() -> None:
    h = CoreHarness(num_blocks=32, block_size=4)
    h.sched.pins.open.add("s")
    history = finished_turn(h)
    h.add("t2", [*history, 40], max_tokens=3, session="s")
    h.run_until_idle()
    assert h.sched.pins.num_pinned_turns == 2
    h.sched.pins.release("s", ("t1", "nope"))
    assert h.sched.pins.num_pinned_turns == 1
    assert h.bm.num_free_blocks == 32 - 6  # t2's 6 full blocks, t1's 5 among them


def test_a_rid_used_twice_keeps_one_pin() -> None:
    """The scheduler takes any request id: pinning a turn's rid again releases the old pin."""
    h = CoreHarness(num_blocks=32, block_size=4)
    h.sched.pins.open.add("s")
    finished_turn(h)
    finished_turn(h)  # "t1" again
    assert h.sched.pins.num_pinned_turns == 1
    h.sched.pins.close("s")
    assert h.bm.num_free_blocks == 32


def test_a_pinned_block_keeps_its_cache_entry() -> None:
    """A session's turn and another request compute the same blocks in one step; the session's
    pinned copies must stay the ones the cache finds (a review found the other request's copy
    taking the entry, and the session's next turn then missed its history)."""
    h = CoreHarness(num_blocks=12, block_size=4)
    h.sched.pins.open.add("s")
    prompt = list(range(1, 10))
    h.add("a", prompt, max_tokens=1, session="s")
    h.add("b", prompt, max_tokens=1)
    h.run_until_idle()
    history = prompt + [t.token_id for t in h.outputs["a"]]
    for i in range(6):  # churn through every free block
        h.add(f"churn{i}", [20 + i] * 9, max_tokens=1)
        h.run_until_idle()
    h.add("a2", [*history, 40], max_tokens=1, session="s")
    h.run_until_idle()
    assert h.outputs["a2"][0].num_cached_tokens == 8
