"""The scheduler actor: a thin trio loop around the pure `Scheduler`.

Three tasks: one receives from the frontend into an inbox, one receives from the worker, and the
step loop drains the inbox, schedules, sends one `StepPlan`, applies the oldest `StepResult` and
sends one `StepOutputs` to the frontend. Requests and aborts that arrive during a step take
effect at the next one.
"""

from __future__ import annotations

import time
from collections import deque

import trio

from runtime.block_manager import BlockManager
from runtime.config import EngineConfig
from runtime.messages import (
    AddRequest,
    EngineReady,
    Ping,
    Pong,
    SchedulerStats,
    StepOutputs,
    StepResult,
    StepTimings,
    Submit,
    WireError,
    WorkerReady,
)
from runtime.scheduler import FinishedOutput, ScheduledStep, Scheduler
from runtime.sequence import Sequence
from runtime.transport import Channel


class SchedulerActor:
    def __init__(
        self,
        config: EngineConfig,
        eos_token_ids: frozenset[int],
        frontend_address: str,
        worker_address: str,
    ) -> None:
        if config.max_model_len <= 0:
            raise ValueError("the scheduler needs a resolved max_model_len")
        self.config = config
        self.eos_token_ids = eos_token_ids
        self.frontend_address = frontend_address
        self.worker_address = worker_address
        self._inbox: list[object] = []
        self._inbox_changed = trio.Event()
        self._results_send, self._results = trio.open_memory_channel[StepResult](1)
        self._next_seq_id = 0
        self._step_id = 0
        self.depth = config.max_steps_in_flight
        self._timing = dict.fromkeys(
            ("schedule", "update", "wait", "prepare", "forward", "sample", "worker_idle"), 0.0
        )
        self._generated_tokens = 0
        self._aborts = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen for the frontend and the worker, wait for `WorkerReady`, then serve steps."""
        with (
            Channel.listen(self.frontend_address) as frontend,
            Channel.listen(self.worker_address) as worker,
        ):
            task_status.started()
            ready = await worker.recv()
            if not isinstance(ready, WorkerReady):
                raise WireError(f"expected WorkerReady, got {type(ready).__name__}")
            self.core = Scheduler(
                BlockManager(
                    ready.num_kv_blocks, self.config.block_size, self.config.enable_prefix_caching
                ),
                max_num_seqs=self.config.max_num_seqs,
                max_num_batched_tokens=self.config.max_num_batched_tokens,
                max_model_len=self.config.max_model_len,
                eos_token_ids=self.eos_token_ids,
            )
            await frontend.send(EngineReady(ready.num_kv_blocks, self.config.max_model_len))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._receive_frontend, frontend)
                nursery.start_soon(self._receive_worker, worker, frontend)
                await self._step_loop(frontend, worker)

    async def _receive_frontend(self, frontend: Channel) -> None:
        while True:
            msg = await frontend.recv()
            self._inbox.append(msg)  # not `self._inbox.append(await ...)`: the list is swapped
            self._inbox_changed.set()

    async def _receive_worker(self, worker: Channel, frontend: Channel) -> None:
        while True:
            msg = await worker.recv()
            match msg:
                case StepResult():
                    await self._results_send.send(msg)
                case Pong(nonce=nonce):  # the whole path answered
                    await frontend.send(Pong(nonce, self.statistics()))
                case _:
                    raise WireError(f"scheduler got an unexpected {type(msg).__name__}")

    async def _step_loop(self, frontend: Channel, worker: Channel) -> None:
        """Keep up to `depth` steps in flight; apply results in order; report each to the
        frontend. With depth 2 the next step waits in the worker's socket while the current one
        computes, so scheduling and messaging cost the worker no time."""
        in_flight: deque[tuple[ScheduledStep, int]] = deque()
        while True:
            if not in_flight and not self._inbox and not self.core.has_work():
                await self._inbox_changed.wait()  # idle: nothing runs until a message comes
            self._inbox_changed = trio.Event()
            changed = await self._drain_inbox(worker)
            scheduled = None
            if len(in_flight) < self.depth and self.core.has_work():
                scheduled = await self._send_step(worker, queued=bool(in_flight))
                if scheduled is not None:
                    in_flight.append(scheduled)
            outputs: list[FinishedOutput] = []
            if in_flight and (len(in_flight) >= self.depth or scheduled is None):
                outputs = await self._apply_result(*in_flight.popleft())
            if outputs or changed:
                await frontend.send(self._outputs_message(outputs))

    async def _drain_inbox(self, worker: Channel) -> bool:
        inbox, self._inbox = self._inbox, []
        for msg in inbox:
            match msg:
                case Submit(adds=adds, aborts=aborts):
                    for add in adds:
                        self._add(add)
                    for rid in aborts:
                        self.core.abort(rid)
                    self._aborts += len(aborts)
                case Ping():
                    await worker.send(msg)
                case _:
                    raise WireError(f"scheduler got an unexpected {type(msg).__name__}")
        return bool(inbox)

    def _add(self, add: AddRequest) -> None:
        # The frontend validated the request; a failure here is a bug, and should be loud.
        self.core.add(Sequence(self._next_seq_id, add.rid, list(add.prompt_token_ids), add.params))
        self._next_seq_id += 1

    async def _send_step(self, worker: Channel, queued: bool) -> tuple[ScheduledStep, int] | None:
        """Schedule and send one step; None if there is nothing to compute right now."""
        start = time.perf_counter()
        scheduled = self.core.schedule()
        if not scheduled.seqs:
            self.core.requeue_released(scheduled)
            return None
        plan = scheduled.to_plan(self._step_id, queued)
        self._step_id += 1
        self._timing["schedule"] += time.perf_counter() - start
        await worker.send(plan)
        return scheduled, plan.step

    async def _apply_result(self, scheduled: ScheduledStep, step_id: int) -> list[FinishedOutput]:
        start = time.perf_counter()
        result = await self._results.receive()
        received = time.perf_counter()
        if result.step != step_id:
            raise WireError(f"worker answered step {result.step}, expected {step_id}")
        self._add_timings(result.timings)
        sampled = {
            s: (t, lp)
            for s, t, lp in zip(result.seq_ids, result.token_ids, result.logprobs, strict=True)
        }
        outputs = self.core.update(scheduled, sampled)
        self._generated_tokens += len(outputs)
        self._timing["wait"] += received - start
        self._timing["update"] += time.perf_counter() - received
        return outputs

    def _add_timings(self, timings: StepTimings) -> None:
        self._timing["prepare"] += timings.prepare
        self._timing["forward"] += timings.forward
        self._timing["sample"] += timings.sample
        self._timing["worker_idle"] += timings.idle

    def _outputs_message(self, outputs: list[FinishedOutput]) -> StepOutputs:
        return StepOutputs(
            rids=tuple(o.rid for o in outputs),
            token_ids=tuple(o.token_id for o in outputs),
            logprobs=tuple(o.logprob for o in outputs),
            finish_reasons=tuple(o.finish_reason for o in outputs),
            num_cached_tokens=tuple(o.num_cached_tokens for o in outputs),
            stats=self.statistics(),
        )

    def statistics(self) -> SchedulerStats:
        core, timing = self.core, self._timing
        return SchedulerStats(
            num_running=len(core.running),
            num_waiting=len(core.waiting),
            num_free_blocks=core.block_manager.num_free_blocks,
            num_total_blocks=core.block_manager.num_blocks,
            num_steps=self._step_id,
            num_preemptions=core.num_preemptions,
            num_aborts=self._aborts,
            num_generated_tokens=self._generated_tokens,
            num_cached_tokens=core.num_cached_tokens,
            schedule_seconds=timing["schedule"],
            update_seconds=timing["update"],
            wait_seconds=timing["wait"],
            prepare_seconds=timing["prepare"],
            forward_seconds=timing["forward"],
            sample_seconds=timing["sample"],
            worker_idle_seconds=timing["worker_idle"],
        )
