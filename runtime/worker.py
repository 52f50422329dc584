"""The worker actor: owns the model and the KV cache, runs one batched step per `StepPlan`."""

from __future__ import annotations

import trio

from runtime.config import EngineConfig
from runtime.messages import Ping, Pong, Shutdown, StepPlan, WireError, WorkerReady
from runtime.model_runner import ModelRunner
from runtime.transport import Channel


class WorkerActor:
    def __init__(self, config: EngineConfig, scheduler_address: str, progress: bool = False):
        self.config = config
        self.scheduler_address = scheduler_address
        self.progress = progress
        # torch runs in one thread at a time, so the trio loop stays free for messages
        self._torch_thread = trio.CapacityLimiter(1)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Load the model, report `WorkerReady`, then serve steps until `Shutdown` or cancel."""
        with Channel.dial(self.scheduler_address) as scheduler:
            runner = await trio.to_thread.run_sync(
                ModelRunner, self.config, self.progress, limiter=self._torch_thread
            )
            await scheduler.send(WorkerReady(runner.num_blocks))
            task_status.started()
            while True:
                msg = await scheduler.recv()
                match msg:
                    case StepPlan():
                        result = await trio.to_thread.run_sync(
                            runner.execute, msg, limiter=self._torch_thread
                        )
                        await scheduler.send(result)
                    case Ping(nonce=nonce):
                        await scheduler.send(Pong(nonce, None))
                    case Shutdown():
                        return
                    case _:
                        raise WireError(f"worker got an unexpected {type(msg).__name__}")
