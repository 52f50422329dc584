"""What a control op does in the scheduler: a pure function of the op and the step pipeline.

The scheduler sees every op first (runtime/wire/control.py). It applies its own (pause,
resume, cache flush, live settings), does its part of a few worker ops (refusing to release
memory while requests run, dropping the prefix cache with the KV pool, tracing its own steps),
and forwards the rest. No trio and no I/O here: tests drive it on a bare pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.scheduler.pipeline import StepPipeline
from runtime.tracing import PhaseTrace
from runtime.wire.codec import WireError
from runtime.wire.control import (
    Configure,
    ControlOp,
    FlushCache,
    Pause,
    ReleaseMemory,
    Resume,
    Scope,
    StartProfile,
    StopProfile,
)


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the actor does with an op: answer `error` now ("" for success), forward it to the
    worker (which answers), or answer once the pause it started has taken hold."""

    error: str = ""
    forward: bool = False
    when_paused: bool = False


DONE = Verdict()
FORWARD = Verdict(forward=True)


def apply(op: ControlOp, pipeline: StepPipeline, trace: PhaseTrace) -> Verdict:
    """Apply the scheduler's part of `op`."""
    core = pipeline.scheduler
    match op:
        case Pause(mode=mode):
            try:
                core.pause(mode)
            except ValueError as exc:
                return Verdict(str(exc))
            return Verdict(when_paused=True)
        case Resume():
            core.resume()
            return DONE
        case FlushCache(allow_open=allow_open):
            try:
                core.flush_cache(allow_open=allow_open)
            except ValueError as exc:
                return Verdict(str(exc))
            return DONE
        case Configure(max_num_seqs=max_num_seqs):
            if max_num_seqs < 1:
                return Verdict("max_num_seqs must be >= 1")
            core.max_num_seqs = max_num_seqs
            return DONE
        case ReleaseMemory(tags=tags):
            refusal = release_refusal(pipeline)
            if refusal:
                return Verdict(refusal)
            if "kv_cache" in tags:
                core.flush_cache(allow_open=True)  # only held requests: they hold no blocks
            return FORWARD
        case StartProfile(request=request):
            if trace.on:
                return Verdict("the scheduler is profiling")
            trace.start(request)
            return FORWARD  # the worker answers once it records too
        case StopProfile():
            trace.stop()  # here, not in a thread: a step may stop it meanwhile
            return FORWARD  # the worker answers once its trace is written
        case _ if op.scope is not Scope.SCHEDULER:
            return FORWARD
    raise WireError(f"the scheduler cannot apply a {type(op).__name__}")


def release_refusal(pipeline: StepPipeline) -> str:
    """Why memory cannot be released now ("" if it can)."""
    core = pipeline.scheduler
    if core.running or core.waiting or pipeline.in_flight:
        return (
            f"cannot release memory while requests run: {len(core.running)} running, "
            f"{len(core.waiting)} waiting (pause with mode abort or wait first)"
        )
    return ""


def pause_took_hold(pipeline: StepPipeline) -> bool:
    """Nothing in flight and, in mode "wait", nothing admitted before the pause left; or a
    resume came first."""
    core = pipeline.scheduler
    if core.pause_mode is None:
        return True
    return not pipeline.in_flight and (core.pause_mode == "keep" or core.drained)
