"""The worker actor: owns the model and the KV cache, runs one batched step per `StepPlan`."""

from __future__ import annotations

import gc
import time

import trio

from runtime.config import EngineConfig
from runtime.wire.codec import WireError
from runtime.wire.messages import (
    ControlDone,
    GetWeights,
    Ping,
    Pong,
    ReleaseMemory,
    ResumeMemory,
    StepPlan,
    StepResult,
    UpdateWeights,
    WeightValues,
    WorkerReady,
    WorkerStats,
)
from runtime.wire.transport import Channel, MessageChannel
from runtime.worker.model_runner import ModelRunner, StepOutcome


class WorkerActor:
    def __init__(self, config: EngineConfig, progress: bool = False) -> None:
        self.config = config
        self.progress = progress
        # In its own process the worker has nothing else to do while the model runs, so it
        # runs it inline; sharing a trio loop with other actors, it runs it in one thread.
        self.inline = config.mode == "process"
        self._torch_thread = trio.CapacityLimiter(1)
        self._stats = WorkerStats()

    def statistics(self) -> WorkerStats:
        """Counters since the worker started, as of the end of its latest step."""
        return self._stats

    async def serve(
        self,
        scheduler_address: str,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Dial the scheduler, then run."""
        with Channel.dial(scheduler_address) as scheduler:
            await self.run(scheduler, task_status=task_status)

    async def run(
        self,
        scheduler: MessageChannel,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Load the model, report `WorkerReady`, then serve steps until cancelled."""
        runner = await trio.to_thread.run_sync(
            ModelRunner, self.config, self.progress, limiter=self._torch_thread
        )
        gc.collect()
        gc.freeze()  # the model's objects live forever: keep them out of every GC pass
        ready = WorkerReady(
            num_kv_blocks=runner.num_blocks,
            dtype=runner.dtype,
            num_threads=runner.num_threads,
            vocab_size=runner.info.vocab_size,
        )
        await scheduler.send(ready)
        task_status.started()
        finished = time.perf_counter()
        while True:
            msg = await scheduler.recv()
            match msg:
                case StepPlan():
                    # waiting for a plan counts as idle only if it was queued behind the
                    # previous step, i.e. it could have been here; else the engine had no work
                    idle = time.perf_counter() - finished if msg.queued else 0.0
                    outcome = await self._execute(runner, msg)
                    self._count(outcome, idle)
                    await scheduler.send(
                        StepResult(
                            msg.step,
                            outcome.seq_ids,
                            outcome.token_ids,
                            outcome.logprobs,
                            self.statistics(),
                        )
                    )
                    finished = time.perf_counter()
                case Ping(nonce=nonce):
                    await scheduler.send(Pong(nonce, None, self.statistics()))
                case GetWeights(nonce=nonce, name=name, truncate_size=count):
                    error, values = runner.weight_values(name, count)
                    await scheduler.send(WeightValues(nonce, error, values))
                case ReleaseMemory(nonce=nonce, tags=tags):
                    runner.release_memory(tags)
                    await self._collect_garbage()
                    await scheduler.send(ControlDone(nonce, ""))
                case ResumeMemory(nonce=nonce, tags=tags):
                    error = await trio.to_thread.run_sync(
                        runner.resume_memory, tags, limiter=self._torch_thread
                    )
                    await scheduler.send(ControlDone(nonce, error))
                case UpdateWeights(nonce=nonce, model_path=path):
                    error = await self._update_weights(runner, path)
                    await scheduler.send(ControlDone(nonce, error))
                case _:
                    raise WireError(f"worker got an unexpected {type(msg).__name__}")

    async def _update_weights(self, runner: ModelRunner, path: str) -> str:
        error = await trio.to_thread.run_sync(
            runner.update_weights, path, limiter=self._torch_thread
        )
        await self._collect_garbage()
        return error

    async def _collect_garbage(self) -> None:
        """Objects frozen at startup (the model's) may be gone now: let the GC see them."""
        await trio.lowlevel.checkpoint()
        gc.unfreeze()
        gc.collect()
        gc.freeze()

    async def _execute(self, runner: ModelRunner, plan: StepPlan) -> StepOutcome:
        if self.inline:
            return runner.execute(plan)
        return await trio.to_thread.run_sync(runner.execute, plan, limiter=self._torch_thread)

    def _count(self, outcome: StepOutcome, idle: float) -> None:
        s = self._stats
        self._stats = WorkerStats(
            num_steps=s.num_steps + 1,
            prepare_seconds=s.prepare_seconds + outcome.prepare_seconds,
            forward_seconds=s.forward_seconds + outcome.forward_seconds,
            sample_seconds=s.sample_seconds + outcome.sample_seconds,
            idle_seconds=s.idle_seconds + idle,
        )
