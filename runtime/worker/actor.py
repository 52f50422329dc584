"""The worker actor: owns the model and the KV cache, runs one batched step per `StepPlan`."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import time

import trio
from torch import distributed as dist

from runtime.config.engine import EngineConfig
from runtime.tracing import actor_name
from runtime.wire.codec import WireError
from runtime.wire.control import Control, ControlDone, ControlOp, Runs, Scope
from runtime.wire.messages import (
    Ping,
    Pong,
    StepPlan,
    StepResult,
    StopShards,
    WorkerReady,
    WorkerStats,
)
from runtime.wire.transport import Channel, MessageChannel
from runtime.worker import tp_group
from runtime.worker.control import WorkerControl
from runtime.worker.model_runner import ModelRunner, StepOutcome
from runtime.worker.profiler import WorkerProfiler
from runtime.worker.shard_follower import start_rank
from runtime.worker.torch_thread import TorchThread


def return_freed_memory() -> None:
    """Trim glibc's heaps. Freed tensors of a few MB come back to the heap, not the system:
    after the first large free, glibc serves allocations under 32 MB from its heaps, and
    keeps what they free. Measured: 340 MB of received weights stayed in the worker's RSS
    after a 100M-parameter update from a trainer."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class WorkerActor:
    """Tensor-parallel rank 0 of its group's model (the whole model without tensor
    parallelism); the other ranks (`shard_follower`) meet it in the store `tp_store`."""

    def __init__(
        self,
        config: EngineConfig,
        progress: bool = False,
        dp_rank: int = 0,
        tp_store: dist.Store | str | None = None,
    ) -> None:
        self.config = config
        self.progress = progress
        self.tp_store = tp_store
        self.name = actor_name("worker", dp_rank, config.data_parallel_size)
        self._torch: TorchThread | None = None  # all its torch work: see torch_thread.py
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
        self._torch = TorchThread(f"{self.name}-torch")
        try:
            await self._load_and_serve(scheduler, task_status)
        finally:
            await self._torch.close()

    async def _load_and_serve(
        self, scheduler: MessageChannel, task_status: trio.TaskStatus[None]
    ) -> None:
        runner = await self.torch.run(self._build_runner)
        gc.collect()
        gc.freeze()  # the model's objects live forever: keep them out of every GC pass
        ready = WorkerReady(
            num_kv_blocks=runner.num_blocks,
            dtype=runner.dtype,
            num_threads=runner.num_threads,
            vocab_size=runner.info.vocab_size,
            tensor_parallel_size=runner.tp.size,
            attention_backend=runner.attention_backend,
            quantization=runner.quantization,
            step_weight_bytes=runner.step_weight_bytes,
        )
        await scheduler.send(ready)
        task_status.started()
        control = WorkerControl(runner, WorkerProfiler(runner.device, self.name))
        async with trio.open_nursery() as nursery:  # ops that run beside steps
            try:
                await self._serve_steps(runner, control, scheduler, nursery)
            finally:
                control.close()
                self._stop_other_ranks(runner)

    @property
    def torch(self) -> TorchThread:
        assert self._torch is not None, "the worker is not running"
        return self._torch

    def _build_runner(self) -> ModelRunner:
        if self.config.tensor_parallel_size == 1:
            return ModelRunner(self.config, self.progress)
        assert self.tp_store is not None, "tensor parallelism needs a store to meet in"
        return start_rank(self.config, 0, self.tp_store, self.progress)

    @staticmethod
    def _stop_other_ranks(runner: ModelRunner) -> None:
        if runner.tp.size > 1:
            with contextlib.suppress(RuntimeError):  # gone already: they stop by themselves
                tp_group.send_message(runner.tp, StopShards())
            tp_group.leave(runner.tp)

    async def _serve_steps(
        self,
        runner: ModelRunner,
        control: WorkerControl,
        scheduler: MessageChannel,
        nursery: trio.Nursery,
    ) -> None:
        profiler = control.profiler
        assert profiler is not None, "rank 0 profiles"
        finished = time.perf_counter()
        while True:
            msg = await scheduler.recv()
            match msg:
                case StepPlan():
                    # waiting for a plan counts as idle only if it was queued behind the
                    # previous step, i.e. it could have been here; else the engine had no work
                    idle = time.perf_counter() - finished if msg.queued else 0.0
                    outcome = await self._execute(runner, msg)
                    self._count(outcome, idle, runner.tp.communicate_seconds)
                    if profiler.counting:  # it may stop: where it started, with the steps
                        await self.torch.run(profiler.step_done)
                    await scheduler.send(
                        StepResult(
                            msg.step,
                            outcome.seq_ids,
                            outcome.token_ids,
                            outcome.logprobs,
                            self.statistics(),
                            outcome.top,
                            outcome.prompt,
                            outcome.pooled_seq_ids,
                            outcome.pooled,
                        )
                    )
                    finished = time.perf_counter()
                case Ping(nonce=nonce):
                    await scheduler.send(Pong(nonce, None, self.statistics()))
                case Control(nonce=nonce, op=op) if op.runs is Runs.BESIDE_STEPS:
                    nursery.start_soon(self._answer, control, scheduler, nonce, op)
                case Control(nonce=nonce, op=op):
                    await self._answer(control, scheduler, nonce, op)
                case _:
                    raise WireError(f"worker got an unexpected {type(msg).__name__}")

    async def _answer(
        self, control: WorkerControl, scheduler: MessageChannel, nonce: int, op: ControlOp
    ) -> None:
        """Apply a control op (on every tensor-parallel rank if it is theirs too), answer."""
        if op.runs is Runs.ON_LOOP:
            error, values = control.apply(op)
        else:

            def on_every_rank() -> tuple[str, tuple[float, ...]]:
                if op.scope is Scope.EVERY_RANK and control.tp.size > 1:
                    tp_group.send_message(control.tp, op)
                return control.apply(op)

            # a trainer that never comes must not stall shutdown
            abandon = op.waits_on_outside
            if op.runs is Runs.BESIDE_STEPS:
                run_beside = trio.to_thread.run_sync
                error, values = await run_beside(on_every_rank, abandon_on_cancel=abandon)
            else:
                error, values = await self.torch.run(on_every_rank, abandon_on_cancel=abandon)
            await self._collect_garbage()  # the op may have dropped tensors
        await scheduler.send(ControlDone(nonce, error, values))

    async def _collect_garbage(self) -> None:
        """Objects frozen at startup (the model's) may be gone now: let the GC see them, and
        hand what they held back to the system."""
        await trio.lowlevel.checkpoint()
        gc.unfreeze()
        gc.collect()
        gc.freeze()
        await self.torch.run(return_freed_memory)

    async def _execute(self, runner: ModelRunner, plan: StepPlan) -> StepOutcome:
        return await self.torch.run(runner.execute, plan)

    def _count(self, outcome: StepOutcome, idle: float, communicated: float) -> None:
        s = self._stats
        self._stats = WorkerStats(
            num_steps=s.num_steps + 1,
            prepare_seconds=s.prepare_seconds + outcome.prepare_seconds,
            forward_seconds=s.forward_seconds + outcome.forward_seconds,
            sample_seconds=s.sample_seconds + outcome.sample_seconds,
            idle_seconds=s.idle_seconds + idle,
            communicate_seconds=communicated,
        )
