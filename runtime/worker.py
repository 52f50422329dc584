"""The worker actor: owns the model and the KV cache, runs one batched step per `StepPlan`."""

from __future__ import annotations

import gc
import time

import trio

from runtime.config import EngineConfig
from runtime.messages import Ping, Pong, StepPlan, StepResult, WireError, WorkerReady
from runtime.model_runner import ModelRunner
from runtime.transport import Channel


class WorkerActor:
    def __init__(self, config: EngineConfig, scheduler_address: str, progress: bool = False):
        self.config = config
        self.scheduler_address = scheduler_address
        self.progress = progress
        # In its own process the worker has nothing else to do while the model runs, so it
        # runs it inline; sharing a trio loop with other actors, it runs it in one thread.
        self.inline = config.mode == "process"
        self._torch_thread = trio.CapacityLimiter(1)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Load the model, report `WorkerReady`, then serve steps until cancelled."""
        with Channel.dial(self.scheduler_address) as scheduler:
            runner = await trio.to_thread.run_sync(
                ModelRunner, self.config, self.progress, limiter=self._torch_thread
            )
            gc.collect()
            gc.freeze()  # the model's objects live forever: keep them out of every GC pass
            await scheduler.send(WorkerReady(runner.num_blocks))
            task_status.started()
            finished = time.perf_counter()
            while True:
                msg = await scheduler.recv()
                match msg:
                    case StepPlan():
                        # waiting for a plan counts as idle only if it was queued behind the
                        # previous step, i.e. it could have been here; else the engine had no work
                        idle = time.perf_counter() - finished if msg.queued else 0.0
                        result = await self._execute(runner, msg, idle)
                        await scheduler.send(result)
                        finished = time.perf_counter()
                    case Ping(nonce=nonce):
                        await scheduler.send(Pong(nonce, None))
                    case _:
                        raise WireError(f"worker got an unexpected {type(msg).__name__}")

    async def _execute(self, runner: ModelRunner, plan: StepPlan, idle: float) -> StepResult:
        if self.inline:
            return runner.execute(plan, idle)
        return await trio.to_thread.run_sync(runner.execute, plan, idle, limiter=self._torch_thread)
