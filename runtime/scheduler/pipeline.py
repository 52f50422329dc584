"""Steps in flight: the rule for when to schedule the next step and when to wait for a result.

The scheduler actor and the tests' harness both run this, so the rule exists once. One turn of
the loop is:

    step = pipeline.schedule_next()          # None: nothing to send this turn
    if step is not None: send it to the worker
    if pipeline.must_retire(step): apply the oldest step's result with `retire`

With `depth` 1 every step waits for its result before the next is scheduled. With 2 the next
step is scheduled (optimistically, see `Scheduler`) and sent while the worker computes the
current one, so it waits in the worker's socket and scheduling costs the worker nothing.

Pure Python, like the scheduler core.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from types import MappingProxyType

from runtime.scheduler.scheduler import Sample, SampledToken, ScheduledStep, Scheduler


class StepPipeline:
    def __init__(self, scheduler: Scheduler, depth: int) -> None:
        if depth not in (1, 2):
            # deeper, a sequence preempted and re-admitted could meet the result of a step
            # planned before its preemption (the scheduler's property tests cover 1 and 2)
            raise ValueError(f"steps in flight must be 1 or 2, got {depth}")
        self.scheduler = scheduler
        self.depth = depth
        self.in_flight: deque[ScheduledStep] = deque()  # oldest first

    @property
    def idle(self) -> bool:
        """Nothing in flight and nothing to schedule: only a new request changes that."""
        return not self.in_flight and not self.scheduler.has_work()

    def schedule_next(self) -> ScheduledStep | None:
        """Schedule a step if there is room in flight and something to compute."""
        if len(self.in_flight) >= self.depth or not self.scheduler.has_work():
            return None
        step = self.scheduler.schedule()
        if step is not None:
            step.queued = bool(self.in_flight)
            self.in_flight.append(step)
        return step

    def must_retire(self, scheduled: ScheduledStep | None) -> bool:
        """Whether this turn waits for the oldest result: the pipeline is full, or nothing new
        could be scheduled (only a result can change that)."""
        return bool(self.in_flight) and (len(self.in_flight) >= self.depth or scheduled is None)

    def retire(
        self,
        step_id: int,
        sampled: dict[int, Sample],
        pooled: Mapping[int, object] = MappingProxyType({}),
    ) -> list[SampledToken]:
        """Apply the oldest step's result; `sampled` and `pooled` (embeddings' vectors): by
        seq_id."""
        step = self.in_flight.popleft()
        if step.step_id != step_id:
            raise ValueError(f"got the result of step {step_id}, expected step {step.step_id}")
        return self.scheduler.update(step, sampled, pooled)
