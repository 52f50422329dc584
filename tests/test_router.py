"""The data-parallel router's rule (runtime/frontend/router.py), stated and checked."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from runtime.frontend.router import Router

BLOCK = 4
PREFIX = list(range(100, 112))  # 3 full blocks: 12 tokens


def test_the_least_loaded_group_wins_and_ties_go_to_the_lower_rank() -> None:
    router = Router(3, BLOCK)
    assert router.route([1, 2, 3], [5, 2, 7]) == 1
    assert router.route([4, 5, 6], [3, 3, 3]) == 0
    assert router.least_loaded([4, 1, 1]) == 1


def test_a_cached_prefix_wins_exactly_while_its_load_is_within_the_prefix_of_the_least() -> None:
    """Group 0 holds 12 prefix tokens: it wins iff L(0) - 12 < L(1) (ties: the lighter)."""
    for load_0, winner in ((12 + 4, 1), (12 + 3, 0), (0, 0)):
        router = Router(2, BLOCK)
        assert router.route(PREFIX, [0, 0]) == 0  # group 0 now holds the prefix
        assert router.route([*PREFIX, 9, 9], [load_0, 4]) == winner, load_0


def test_only_the_leading_blocks_held_count() -> None:
    other = [*PREFIX[:4], 0, 0, 0, 0, *PREFIX[8:]]  # shares the first block only
    # group 0 matches 4 tokens: 9 - 4 = 5 > 4, so the lighter group 1 wins; 8 - 4 < 5 wins
    for loads, winner in (([9, 4], 1), ([8, 5], 0)):
        router = Router(2, BLOCK)
        router.route(PREFIX, [0, 0])  # group 0: all 3 blocks
        assert router.route(other, loads) == winner


def test_a_prefix_sent_to_several_groups_counts_for_each() -> None:
    router = Router(3, BLOCK)
    router.route(PREFIX, [0, 9, 9])  # -> 0
    router.route(PREFIX, [20, 0, 9])  # -> 1 (20 - 12 > 0)
    assert router.route(PREFIX, [13, 12, 1]) == 1  # both hold it: scores 1, 0, 1


def test_forget_and_the_size_cap() -> None:
    router = Router(2, BLOCK, max_entries=3)
    router.route(PREFIX, [0, 0])
    router.forget()
    assert router.route(PREFIX, [1, 0]) == 1  # nothing held any more: the lighter wins
    router.route([7] * 8, [0, 0])  # 2 more blocks: the oldest of PREFIX's go
    assert len(router._groups_of) == 3


def test_prompts_shorter_than_a_block_are_balanced_plainly() -> None:
    router = Router(2, BLOCK)
    router.route([1, 2, 3], [0, 0])
    assert router.route([1, 2, 3], [1, 0]) == 1


@given(
    prompts=st.lists(st.lists(st.integers(0, 3), max_size=14), min_size=1, max_size=12),
    loads=st.lists(st.integers(0, 40), min_size=3, max_size=3),
)
def test_the_chosen_group_always_has_the_smallest_score(
    prompts: list[list[int]], loads: list[int]
) -> None:
    router = Router(3, BLOCK)
    for prompt in prompts[:-1]:
        router.route(prompt, loads)
    prompt = prompts[-1]
    matched = router._matched_tokens(router._digests(prompt))
    chosen = router.route(prompt, loads)
    scores = [load - held for load, held in zip(loads, matched, strict=True)]
    assert scores[chosen] == min(scores)
    assert all(m % BLOCK == 0 and m <= len(prompt) for m in matched)
