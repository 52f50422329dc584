"""Random interleavings of session turns, pins, aborts, flushes, pauses and preemption on the
pure scheduler (found by a review helper): every block's references stay exact, every computed
position still holds its token's KV when read, and closing every session frees every block."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.core_harness import CoreHarness


class KVHarness(CoreHarness):
    """Also models the KV cache contents: each block slot holds (token, weights version)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.kv: dict[int, list[tuple[int, int] | None]] = {}  # block -> (token, version)
        self.version = 0
        self.prompts: dict[str, list[int]] = {}

    def add(self, rid: str, prompt: list[int], max_tokens: int, *args: Any, **kw: Any) -> None:
        super().add(rid, prompt, max_tokens, *args, **kw)
        self.prompts[rid] = prompt

    def history(self, rid: str) -> list[int]:
        return self.prompts.get(rid, []) + [t.token_id for t in self.outputs.get(rid, [])]

    def _retire(self, abort_in_flight: tuple[str, ...]) -> None:
        plan = self.plans[0]
        bs = self.bm.block_size
        saved = copy.deepcopy(self.worker.seqs)  # apply the plan on a copy, to read its tables
        for ws, n in zip(self.worker.apply(plan), plan.num_tokens, strict=True):
            for p in range(ws.num_computed_tokens):  # what the step reads
                slot = self.kv.get(ws.block_table[p // bs], [None] * bs)[p % bs]
                assert slot is not None and slot[0] == ws.token_ids[p], ("stale KV", p, slot)
            for p in range(ws.num_computed_tokens, ws.num_computed_tokens + n):
                block = self.kv.setdefault(ws.block_table[p // bs], [None] * bs)
                block[p % bs] = (ws.token_ids[p], self.version)
        self.worker.seqs = saved
        super()._retire(abort_in_flight)

    def check_invariants(self) -> None:
        super().check_invariants()
        for b in self.sched.pins.pinned_blocks():
            assert self.bm.blocks[b].hash is not None, ("pinned but evicted", b)


SESSIONS = ["s0", "s1", "s2"]

tokens = st.integers(1, 7)
op = st.one_of(
    # a turn of session i continuing request parent (if of that session), new tokens, its
    # max_tokens, whether it reuses the parent's rid, and an offset into the history
    st.tuples(
        st.just("turn"),
        st.integers(0, 2),
        st.integers(0, 30),
        st.lists(tokens, max_size=6),
        st.integers(1, 6),
        st.booleans(),
        st.integers(-8, 0),
    ),
    st.tuples(st.just("plain"), st.lists(tokens, min_size=1, max_size=14), st.integers(1, 6)),
    st.tuples(st.just("step"), st.lists(st.integers(0, 40), max_size=2)),
    st.tuples(st.just("step"), st.just([])),
    st.tuples(st.just("step"), st.just([])),
    st.tuples(st.just("abort"), st.integers(0, 40)),
    st.tuples(st.just("open"), st.integers(0, 2)),
    st.tuples(st.just("close"), st.integers(0, 2)),
    st.tuples(st.just("release"), st.integers(0, 2), st.lists(st.integers(0, 40), max_size=3)),
    st.tuples(st.just("flush"), st.booleans()),
    st.tuples(st.just("pause"), st.sampled_from(["keep", "wait", "retract"])),
    st.tuples(st.just("resume")),
    st.tuples(st.just("seqs"), st.integers(1, 6)),
)


def run(
    ops: list[tuple[Any, ...]],
    num_blocks: int,
    block_size: int,
    budget: int,
    depth: int,
    reuse_rids: bool,
    max_num_seqs: int = 4,
) -> None:
    h = KVHarness(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_model_len=min(32, num_blocks * block_size),
        depth=depth,
        max_num_seqs=max_num_seqs,
    )
    session_of: dict[str, str] = {}
    n = 0
    for o in ops:
        kind = o[0]
        if kind == "turn":
            _, si, parent_i, new, mt, reuse, offset = o
            s = SESSIONS[si]
            parent = f"r{parent_i}"
            base = h.history(parent) if session_of.get(parent) == s else []
            if offset:
                base = base[:offset]
            prompt = base + new
            if not prompt:
                prompt = [1]
            mt = min(mt, h.sched.max_model_len - len(prompt))
            if mt < 1:
                continue
            rid = f"r{parent_i}" if (reuse and reuse_rids) else f"r{n}"
            if rid in h.sched.by_rid:
                continue
            h.add(rid, prompt, mt, ignore_eos=False, session=s)
            session_of[rid] = s
            n += 1
        elif kind == "plain":
            _, prompt, mt = o
            mt = min(mt, h.sched.max_model_len - len(prompt))
            if mt >= 1 and f"r{n}" not in h.sched.by_rid:
                rid = f"r{n}"
                h.add(rid, prompt, mt, ignore_eos=False)
                session_of[rid] = ""
                n += 1
        elif kind == "step":
            h.step(abort_in_flight=tuple(f"r{i}" for i in o[1]))
        elif kind == "abort":
            h.abort(f"r{o[1]}")
        elif kind == "open":
            h.sched.pins.open.add(SESSIONS[o[1]])
        elif kind == "close":
            h.sched.pins.close(SESSIONS[o[1]])
        elif kind == "release":
            h.sched.pins.release(SESSIONS[o[1]], tuple(f"r{i}" for i in o[2]))
        elif kind == "flush":
            if o[1]:
                h.sched.flush_cache(allow_open=True)
                h.version += 1
            else:
                try:
                    h.sched.flush_cache()
                    h.version += 1
                except ValueError:
                    pass
        elif kind == "pause":
            h.sched.pause(o[1])
        elif kind == "resume":
            h.sched.resume()
        elif kind == "seqs":
            h.sched.max_num_seqs = max(o[1], len(h.sched.running))
        h.check_invariants()
    h.sched.resume()
    h.run_until_idle()
    for s in SESSIONS:
        h.sched.pins.close(s)
    h.check_invariants()
    assert h.bm.num_free_blocks == h.bm.num_blocks


SIZES = {
    "num_blocks": st.integers(4, 16),
    "block_size": st.sampled_from([1, 2, 4]),
    "budget": st.integers(1, 16),
    "depth": st.sampled_from([1, 2]),
}


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=st.lists(op, max_size=80), max_num_seqs=st.integers(1, 5), **SIZES)
def test_sessions_pins_and_preemption(
    ops: list[tuple[Any, ...]],
    num_blocks: int,
    block_size: int,
    budget: int,
    depth: int,
    max_num_seqs: int,
) -> None:
    run(ops, num_blocks, block_size, budget, depth, reuse_rids=False, max_num_seqs=max_num_seqs)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=st.lists(op, max_size=80), **SIZES)
def test_a_reused_rid_keeps_one_pin(
    ops: list[tuple[Any, ...]], num_blocks: int, block_size: int, budget: int, depth: int
) -> None:
    """The scheduler takes any request id: a turn's rid used twice must not leak blocks."""
    run(ops, num_blocks, block_size, budget, depth, reuse_rids=True)
