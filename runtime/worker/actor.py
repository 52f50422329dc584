"""The worker actor: owns the model and the KV cache, runs one batched step per `StepPlan`."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import time
from collections.abc import Callable

import trio
from torch import distributed as dist

from runtime.config.engine import EngineConfig
from runtime.tracing import actor_name
from runtime.wire.codec import WireError
from runtime.wire.messages import (
    ControlDone,
    GetWeights,
    JoinWeightGroup,
    LeaveWeightGroup,
    Ping,
    Pong,
    ReleaseMemory,
    ResumeMemory,
    StartProfile,
    StepPlan,
    StepResult,
    StopProfile,
    StopShards,
    UpdateWeights,
    UpdateWeightsFromFile,
    UpdateWeightsFromGroup,
    WeightValues,
    WorkerReady,
    WorkerStats,
)
from runtime.wire.transport import Channel, MessageChannel
from runtime.worker import rank_control, tp_group, weight_group
from runtime.worker.model_runner import ModelRunner, StepOutcome
from runtime.worker.profiler import WorkerProfiler
from runtime.worker.rank_control import RankControl
from runtime.worker.shard_follower import start_rank
from runtime.worker.weight_group import WeightGroup


def return_freed_memory() -> None:
    """Trim glibc's heaps. Freed tensors of a few MB come back to the heap, not the system:
    after the first large free, glibc serves allocations under 32 MB from its heaps, and
    keeps what they free. Measured: 340 MB of received weights stayed in the worker's RSS
    after a 100M-parameter update from a trainer."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)


# Each rank would join the trainer's group and slice its share out of every broadcast: not
# built yet, and refusing is better than serving a model whose ranks disagree.
NOT_WITH_TP = "weight update groups are not available with --tensor-parallel-size > 1 yet"


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
        # In its own process the worker has nothing else to do while the model runs, so it
        # runs it inline; sharing a trio loop with other actors, it runs it in one thread.
        self.inline = config.mode == "process"
        self._torch_thread = trio.CapacityLimiter(1)
        self._stats = WorkerStats()
        self._groups: dict[str, WeightGroup | None] = {}  # None: joining

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
        runner = await trio.to_thread.run_sync(self._build_runner, limiter=self._torch_thread)
        gc.collect()
        gc.freeze()  # the model's objects live forever: keep them out of every GC pass
        ready = WorkerReady(
            num_kv_blocks=runner.num_blocks,
            dtype=runner.dtype,
            num_threads=runner.num_threads,
            vocab_size=runner.info.vocab_size,
            tensor_parallel_size=runner.tp.size,
            attention_backend=runner.attention_backend,
        )
        await scheduler.send(ready)
        task_status.started()
        async with trio.open_nursery() as nursery:  # group joins, which wait on the trainer
            try:
                await self._serve_steps(runner, scheduler, nursery)
            finally:
                for group in self._groups.values():
                    if group is not None:
                        weight_group.leave(group)
                self._stop_other_ranks(runner)

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
        self, runner: ModelRunner, scheduler: MessageChannel, nursery: trio.Nursery
    ) -> None:
        finished = time.perf_counter()
        profiler = WorkerProfiler(runner.device, self.name)
        while True:
            msg = await scheduler.recv()
            match msg:
                case StepPlan():
                    # waiting for a plan counts as idle only if it was queued behind the
                    # previous step, i.e. it could have been here; else the engine had no work
                    idle = time.perf_counter() - finished if msg.queued else 0.0
                    outcome = await self._execute(runner, msg)
                    self._count(outcome, idle, runner.tp.communicate_seconds)
                    profiler.step_done()
                    await scheduler.send(
                        StepResult(
                            msg.step,
                            outcome.seq_ids,
                            outcome.token_ids,
                            outcome.logprobs,
                            self.statistics(),
                            outcome.top,
                            outcome.prompt,
                        )
                    )
                    finished = time.perf_counter()
                case Ping(nonce=nonce):
                    await scheduler.send(Pong(nonce, None, self.statistics()))
                case (
                    ReleaseMemory()
                    | ResumeMemory()
                    | UpdateWeights()
                    | UpdateWeightsFromFile()
                    | GetWeights()
                ) if runner.tp.size > 1:
                    await scheduler.send(await self._on_every_rank(runner, msg))
                case JoinWeightGroup() | UpdateWeightsFromGroup() if runner.tp.size > 1:
                    await scheduler.send(ControlDone(msg.nonce, NOT_WITH_TP))
                case StartProfile(nonce=nonce, request=request):
                    await scheduler.send(ControlDone(nonce, profiler.start(request)))
                case StopProfile(nonce=nonce):
                    # on the thread that started it (the export blocks while it writes)
                    await scheduler.send(ControlDone(nonce, profiler.stop()))
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
                    error = await self._in_torch_thread(runner.update_weights, path)
                    await scheduler.send(ControlDone(nonce, error))
                case UpdateWeightsFromFile(nonce=nonce, path=path):
                    error = await self._in_torch_thread(runner.install_file, path)
                    await scheduler.send(ControlDone(nonce, error))
                case JoinWeightGroup():
                    error = self._check_new_group(msg.group_name)
                    if error:
                        await scheduler.send(ControlDone(msg.nonce, error))
                    else:
                        self._groups[msg.group_name] = None
                        nursery.start_soon(self._join_group, runner, scheduler, msg)
                case UpdateWeightsFromGroup(nonce=nonce):
                    error = await self._update_from_group(runner, msg)
                    await scheduler.send(ControlDone(nonce, error))
                case LeaveWeightGroup(nonce=nonce, group_name=name):
                    error = self._leave_group(name)
                    await scheduler.send(ControlDone(nonce, error))
                case _:
                    raise WireError(f"worker got an unexpected {type(msg).__name__}")

    async def _on_every_rank(self, runner: ModelRunner, msg: RankControl) -> object:
        """A control message run on every tensor-parallel rank, in step (rank_control)."""

        def run() -> tuple[str, tuple[float, ...]]:
            tp_group.send_message(runner.tp, msg)
            return rank_control.apply(runner, msg)

        error, values = await trio.to_thread.run_sync(run, limiter=self._torch_thread)
        if isinstance(msg, GetWeights):
            return WeightValues(msg.nonce, error, values)
        await self._collect_garbage()
        return ControlDone(msg.nonce, error)

    async def _in_torch_thread(self, update: Callable[[str], str], path: str) -> str:
        error = await trio.to_thread.run_sync(update, path, limiter=self._torch_thread)
        await self._collect_garbage()
        return error

    # -- weights from a trainer's torch.distributed world (runtime.worker.weight_group) ----

    def _check_new_group(self, name: str) -> str:
        if name in self._groups:
            return f"a weight update group named {name!r} exists already"
        return ""

    async def _join_group(
        self, runner: ModelRunner, scheduler: MessageChannel, msg: JoinWeightGroup
    ) -> None:
        """Join in a thread of its own: steps go on while the trainer comes."""
        try:
            group = await trio.to_thread.run_sync(
                weight_group.join,
                msg.master_address,
                msg.master_port,
                msg.rank_offset,
                msg.world_size,
                msg.backend,
                runner.device,
                abandon_on_cancel=True,  # a trainer that never comes must not stall shutdown
            )
        except weight_group.WeightGroupError as exc:
            del self._groups[msg.group_name]
            await scheduler.send(ControlDone(msg.nonce, str(exc)))
            return
        self._groups[msg.group_name] = group
        await scheduler.send(ControlDone(msg.nonce, ""))

    async def _update_from_group(self, runner: ModelRunner, msg: UpdateWeightsFromGroup) -> str:
        group = self._groups.get(msg.group_name)
        if group is None:
            return f"no weight update group named {msg.group_name!r} (init it first)"
        try:
            specs = weight_group.parse_specs(msg.names, msg.dtypes, msg.shapes)
        except weight_group.WeightGroupError as exc:
            return self._drop_group(msg.group_name, str(exc))
        error = runner.check_tensors(specs)
        if error:  # nothing received: the trainer's broadcasts have no receiver
            return self._drop_group(msg.group_name, error)
        try:
            tensors = await trio.to_thread.run_sync(
                weight_group.receive,
                group,
                specs,
                limiter=self._torch_thread,
                abandon_on_cancel=True,  # as for joining
            )
        except weight_group.WeightGroupError as exc:
            return self._drop_group(msg.group_name, str(exc))
        error = await trio.to_thread.run_sync(
            runner.install_tensors, tensors, limiter=self._torch_thread
        )
        del tensors
        await self._collect_garbage()
        return error

    def _drop_group(self, name: str, error: str) -> str:
        """A failed update leaves the group out of step with the trainer: leave it."""
        self._leave_group(name)
        return f"{error} (the weight update group {name!r} was left: init it again)"

    def _leave_group(self, name: str) -> str:
        group = self._groups.get(name)
        if group is None:  # unknown, or still joining
            return f"no weight update group named {name!r}"
        del self._groups[name]
        weight_group.leave(group)
        return ""

    async def _collect_garbage(self) -> None:
        """Objects frozen at startup (the model's) may be gone now: let the GC see them, and
        hand what they held back to the system."""
        await trio.lowlevel.checkpoint()
        gc.unfreeze()
        gc.collect()
        gc.freeze()
        await trio.to_thread.run_sync(return_freed_memory, limiter=self._torch_thread)

    async def _execute(self, runner: ModelRunner, plan: StepPlan) -> StepOutcome:
        if self.inline:
            return runner.execute(plan)
        return await trio.to_thread.run_sync(runner.execute, plan, limiter=self._torch_thread)

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
