"""What control ops do in the scheduler (runtime/scheduler/control.py), on a bare pipeline:
no trio, no actor."""

from __future__ import annotations

from runtime.scheduler import control
from runtime.tracing import PhaseTrace, ProfileRequest
from runtime.wire.control import (
    Configure,
    FlushCache,
    GetWeights,
    JoinWeightGroup,
    Pause,
    ReleaseMemory,
    Resume,
    StartProfile,
    StopProfile,
    UpdateWeights,
)
from tests.core_harness import CoreHarness


def apply(h: CoreHarness, op: object, trace: PhaseTrace | None = None) -> control.Verdict:
    return control.apply(op, h.pipeline, trace or PhaseTrace("scheduler"))  # type: ignore[arg-type]


def test_worker_ops_are_forwarded_untouched() -> None:
    h = CoreHarness()
    for op in (UpdateWeights("/x"), GetWeights("w", 3), JoinWeightGroup("g", "a", 1, 1, 2, "")):
        assert apply(h, op) == control.FORWARD


def test_a_pause_is_answered_once_it_holds_and_a_resume_at_once() -> None:
    h = CoreHarness(depth=2)
    h.add("a", [1, 2, 3], max_tokens=8)
    h.step()
    assert apply(h, Pause("keep")) == control.Verdict(when_paused=True)
    assert not control.pause_took_hold(h.pipeline)  # a step is still computing
    while h.pipeline.in_flight:
        h.step()
    assert control.pause_took_hold(h.pipeline)
    assert "pause mode must be" in apply(h, Pause("abort")).error  # the frontend's to map
    assert apply(h, Resume()) == control.DONE
    assert h.sched.pause_mode is None


def test_a_flush_is_refused_while_requests_are_open_unless_after_an_update() -> None:
    h = CoreHarness()
    h.add("a", [1, 2, 3], max_tokens=4)
    assert "cannot flush" in apply(h, FlushCache(False)).error
    assert apply(h, FlushCache(True)) == control.DONE


def test_live_settings_are_checked_then_applied() -> None:
    h = CoreHarness(max_num_seqs=8)
    assert apply(h, Configure(0)).error == "max_num_seqs must be >= 1"
    assert apply(h, Configure(3)) == control.DONE and h.sched.max_num_seqs == 3


def test_memory_is_released_only_when_nothing_runs_and_the_cache_goes_with_the_kv() -> None:
    h = CoreHarness()
    h.add("a", [1, 2, 3, 4, 5, 6, 7, 8, 9], max_tokens=1)
    assert "cannot release memory while requests run: 0 running, 1 waiting" in (
        apply(h, ReleaseMemory(("kv_cache",))).error
    )
    while h.sched.has_work() or h.pipeline.in_flight:
        h.step()
    assert h.bm.cached  # the finished prompt's blocks
    assert apply(h, ReleaseMemory(("weights",))) == control.FORWARD and h.bm.cached
    assert apply(h, ReleaseMemory(("kv_cache",))) == control.FORWARD and not h.bm.cached


def test_profiles_start_the_schedulers_own_trace_then_go_to_the_worker(tmp_path: object) -> None:
    h, trace = CoreHarness(), PhaseTrace("scheduler")
    request = ProfileRequest(str(tmp_path), 0, ("CPU",), False, False)
    assert apply(h, StartProfile(request), trace) == control.FORWARD and trace.on
    assert apply(h, StartProfile(request), trace).error == "the scheduler is profiling"
    assert apply(h, StopProfile(), trace) == control.FORWARD and not trace.on
