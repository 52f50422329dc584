"""The scheduler actor: a thin trio loop around the pure `Scheduler` and its `StepPipeline`.

Three tasks: one receives from the frontend into an inbox, one receives from the worker, and the
step loop drains the inbox, lets the pipeline schedule (sending one `StepPlan`) and retire the
oldest step (its `StepResult`), and sends one `StepOutputs` to the frontend. Requests and aborts
that arrive during a step take effect at the next one.

The channels are injected: nng sockets in the engine (`serve`), anything with the same `send` and
`recv` in tests.
"""

from __future__ import annotations

import time

import trio

from runtime.config.engine import EngineConfig
from runtime.scheduler import control
from runtime.scheduler.block_manager import BlockManager
from runtime.scheduler.pipeline import StepPipeline
from runtime.scheduler.scheduler import Sample, SampledToken, ScheduledStep, Scheduler
from runtime.scheduler.sequence import Sequence
from runtime.tracing import PhaseTrace, actor_name
from runtime.wire.codec import WireError
from runtime.wire.control import Control, ControlDone
from runtime.wire.messages import (
    AddRequest,
    EngineReady,
    NewSeq,
    OpenSession,
    Ping,
    Pong,
    Probe,
    Rejected,
    ReleaseTurns,
    SchedulerStats,
    StepOutputs,
    StepPlan,
    StepResult,
    Submit,
    WorkerReady,
    WorkerStats,
)
from runtime.wire.transport import Channel, MessageChannel


class SchedulerActor:
    def __init__(
        self, config: EngineConfig, eos_token_ids: frozenset[int], dp_rank: int = 0
    ) -> None:
        if config.max_model_len <= 0:
            raise ValueError("the scheduler needs a resolved max_model_len")
        self.config = config
        self.eos_token_ids = eos_token_ids
        self.worker_stats = WorkerStats()  # the latest the worker sent
        self._inbox: list[object] = []
        self._pongs: list[int] = []  # the worker answered these pings: relay them
        self._pausing: list[int] = []  # nonces of Pause messages not answered yet
        self.trace = PhaseTrace(
            actor_name("scheduler", dp_rank, config.data_parallel_size)
        )  # while profiling (start_profile)
        self._relay: list[ControlDone] = []  # the worker's answers: relayed
        self._inbox_changed = trio.Event()
        self._results_send, self._results = trio.open_memory_channel[StepResult](1)
        self._next_seq_id = 0
        self._num_aborts = 0
        self._num_generated_tokens = 0
        self._schedule_seconds = 0.0
        self._update_seconds = 0.0
        self._wait_seconds = 0.0

    async def serve(
        self,
        frontend_address: str,
        worker_address: str,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen for the frontend and the worker (`started()` once they can dial), then run."""
        with Channel.listen(frontend_address) as frontend, Channel.listen(worker_address) as worker:
            task_status.started()
            await self.run(frontend, worker)

    async def run(self, frontend: MessageChannel, worker: MessageChannel) -> None:
        """Wait for `WorkerReady`, announce `EngineReady`, then serve steps until cancelled."""
        ready = await worker.recv()
        if not isinstance(ready, WorkerReady):
            raise WireError(f"expected WorkerReady, got {type(ready).__name__}")
        core = self._make_core(ready.num_kv_blocks, ready.vocab_size)
        self.pipeline = StepPipeline(core, self.depth)
        await frontend.send(EngineReady(self.config.max_model_len, self.depth, ready))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._receive_frontend, frontend)
            nursery.start_soon(self._receive_worker, worker, frontend)
            await self._step_loop(frontend, worker)

    @property
    def depth(self) -> int:
        return self.config.max_steps_in_flight

    def _make_core(self, num_blocks: int, vocab_size: int) -> Scheduler:
        config = self.config
        return Scheduler(
            BlockManager(num_blocks, config.block_size, config.enable_prefix_caching),
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            eos_token_ids=self.eos_token_ids,
            vocab_size=vocab_size,
        )

    async def _receive_frontend(self, frontend: MessageChannel) -> None:
        while True:
            msg = await frontend.recv()
            if isinstance(msg, Probe):  # answered here, even while a step waits on the worker
                await frontend.send(Pong(msg.nonce, None, None))
                continue
            self._inbox.append(msg)  # not `self._inbox.append(await ...)`: the list is swapped
            self._inbox_changed.set()

    async def _receive_worker(self, worker: MessageChannel, frontend: MessageChannel) -> None:
        while True:
            msg = await worker.recv()
            match msg:
                case StepResult():
                    await self._results_send.send(msg)
                case Pong(nonce=nonce, worker=stats):  # the step loop relays it
                    self.worker_stats = stats or self.worker_stats
                    self._pongs.append(nonce)
                    self._inbox_changed.set()
                case ControlDone():  # the step loop relays it
                    self._relay.append(msg)
                    self._inbox_changed.set()
                case _:
                    raise WireError(f"scheduler got an unexpected {type(msg).__name__}")

    async def _step_loop(self, frontend: MessageChannel, worker: MessageChannel) -> None:
        """The only task that sends statistics to the frontend, so it reads them in the order
        they were taken: a snapshot is never followed by an older one."""
        pipeline = self.pipeline
        while True:
            if pipeline.idle and not self._inbox and not self._pongs and not self._relay:
                await self._inbox_changed.wait()  # nothing runs until a message comes
            self._inbox_changed = trio.Event()
            changed = await self._drain_inbox(worker, frontend)
            started = time.perf_counter()
            step = pipeline.schedule_next()
            plan = plan_message(step) if step is not None else None
            scheduled = time.perf_counter()
            self._schedule_seconds += scheduled - started
            if self.trace.on and step is not None:
                self.trace.span("schedule", started, scheduled, step=step.step_id)
                self.trace.step_done()
            if plan is not None:
                await worker.send(plan)
            outputs: list[SampledToken] = []
            retired = pipeline.must_retire(step)
            if retired:
                outputs = await self._retire()
            # at rest the frontend gets a last report, so its snapshot of our stats is exact
            if outputs or changed or (retired and pipeline.idle):
                await frontend.send(self._outputs_message(outputs))
            pongs, self._pongs = self._pongs, []
            for nonce in pongs:  # the whole path answered
                await frontend.send(Pong(nonce, self.statistics(), self.worker_stats))
            relay, self._relay = self._relay, []
            for answer in relay:
                await frontend.send(answer)
            if self._pausing and control.pause_took_hold(pipeline):
                pausing, self._pausing = self._pausing, []
                for nonce in pausing:
                    await frontend.send(ControlDone(nonce, ""))

    async def _drain_inbox(self, worker: MessageChannel, frontend: MessageChannel) -> bool:
        """Apply what the frontend sent; True if requests were added or aborted."""
        inbox, self._inbox = self._inbox, []
        submitted = False
        for msg in inbox:
            match msg:
                case Submit(adds=adds, aborts=aborts):
                    submitted = True
                    for add in adds:
                        reason = self._add(add)
                        if reason is not None:
                            await frontend.send(Rejected(add.rid, reason))
                    for rid in aborts:
                        self.pipeline.scheduler.abort(rid)
                    self._num_aborts += len(aborts)
                case Ping():
                    await worker.send(msg)
                case Control(nonce=nonce, op=op):
                    verdict = control.apply(op, self.pipeline, self.trace)
                    if verdict.forward:
                        await worker.send(msg)  # after the steps already sent: in order
                    elif verdict.when_paused:
                        self._pausing.append(nonce)
                    else:
                        await frontend.send(self._outputs_message([]))  # stats show it first
                        await frontend.send(ControlDone(nonce, verdict.error))
                case OpenSession(session=session):
                    self.pipeline.scheduler.pins.open.add(session)
                case ReleaseTurns(session=session, rids=rids, close=close):
                    pins = self.pipeline.scheduler.pins
                    if close:
                        pins.close(session)
                    else:
                        pins.release(session, rids)
                    submitted = True  # freed blocks: the frontend's stats are out of date
                case _:
                    raise WireError(f"scheduler got an unexpected {type(msg).__name__}")
        return submitted

    def _add(self, add: AddRequest) -> str | None:
        """Queue a request; why not, if it cannot be served. The frontend validated it, but a
        request's data must never be able to stop the actor that everyone shares."""
        try:
            seq = Sequence(
                self._next_seq_id,
                add.rid,
                list(add.prompt_token_ids),
                add.params,
                max_tokens=add.max_tokens,
                session=add.session,
                pooling=add.pooling,
            )
            self.pipeline.scheduler.add(seq, add.fork_of)
        except ValueError as exc:
            return str(exc)
        self._next_seq_id += 1
        return None

    async def _retire(self) -> list[SampledToken]:
        """Wait for the oldest step's result and apply it."""
        started = time.perf_counter()
        result = await self._results.receive()
        received = time.perf_counter()
        self.worker_stats = result.stats
        none = (None,) * len(result.seq_ids)
        sampled: dict[int, Sample] = dict(
            zip(
                result.seq_ids,
                zip(
                    result.token_ids,
                    result.logprobs,
                    result.top or none,
                    result.prompt or none,
                    strict=True,
                ),
                strict=True,
            )
        )
        pooled = dict(zip(result.pooled_seq_ids, result.pooled, strict=True))
        outputs = self.pipeline.retire(result.step, sampled, pooled)
        self._num_generated_tokens += sum(1 for out in outputs if out.embedding is None)
        updated = time.perf_counter()
        self._wait_seconds += received - started
        self._update_seconds += updated - received
        if self.trace.on:
            self.trace.span("wait_for_worker", started, received, step=result.step)
            self.trace.span("update", received, updated, step=result.step)
        return outputs

    def _outputs_message(self, outputs: list[SampledToken]) -> StepOutputs:
        top = tuple([o.top for o in outputs])
        prompt = tuple([o.prompt for o in outputs])
        embeddings = tuple([o.embedding for o in outputs])
        return StepOutputs(
            # from lists, not generators: see runtime/wire/codec.py on tuple free lists
            rids=tuple([o.rid for o in outputs]),
            token_ids=tuple([o.token_id for o in outputs]),
            logprobs=tuple([o.logprob for o in outputs]),
            finish_reasons=tuple([o.finish_reason for o in outputs]),
            num_cached_tokens=tuple([o.num_cached_tokens for o in outputs]),
            scheduler=self.statistics(),
            worker=self.worker_stats,
            top=top if any(x is not None for x in top) else (),  # type: ignore[arg-type]
            prompt=prompt if any(x is not None for x in prompt) else (),  # type: ignore[arg-type]
            embeddings=(
                embeddings  # type: ignore[arg-type]
                if any(x is not None for x in embeddings)
                else ()
            ),
        )

    def statistics(self) -> SchedulerStats:
        core = self.pipeline.scheduler
        return SchedulerStats(
            num_running=len(core.running),
            num_waiting=len(core.waiting) + core.num_forking,
            num_free_blocks=core.block_manager.num_free_blocks,
            num_total_blocks=core.block_manager.num_blocks,
            num_steps=core.num_steps,
            num_preemptions=core.num_preemptions,
            num_aborts=self._num_aborts,
            num_generated_tokens=self._num_generated_tokens,
            num_cached_tokens=core.num_cached_tokens,
            schedule_seconds=self._schedule_seconds,
            update_seconds=self._update_seconds,
            wait_seconds=self._wait_seconds,
            num_held=len(core.held),
            num_waiting_uncached_tokens=core.queued_tokens,
            max_num_seqs=core.max_num_seqs,
            num_embeddings=core.num_embeddings,
            num_embedding_tokens=core.num_embedding_tokens,
        )


def plan_message(step: ScheduledStep) -> StepPlan:
    """The wire form of a step, as the worker's `SeqTable` applies it."""
    start_of: dict[int, int] = {}
    if step.new_seqs:  # where each new sequence's part of this step starts
        start_of = {seq.seq_id: start for seq, start in zip(step.seqs, step.starts, strict=True)}
    return StepPlan(
        step=step.step_id,
        # a new sequence's state as of this step's start: tokens are appended only by update()
        new_seqs=tuple(
            [
                NewSeq(
                    seq_id=seq.seq_id,
                    token_ids=tuple(seq.token_ids),
                    num_prompt_tokens=seq.num_prompt_tokens,
                    num_computed_tokens=start_of[seq.seq_id],
                    params=seq.params,
                    pooling=seq.pooling,
                )
                for seq in step.new_seqs
            ]
        ),
        seq_ids=tuple([seq.seq_id for seq in step.seqs]),
        num_tokens=tuple(step.num_tokens),
        block_seq_ids=tuple([seq_id for seq_id, _ in step.new_blocks]),
        block_ids=tuple([block_id for _, block_id in step.new_blocks]),
        released=tuple(step.released),
        queued=step.queued,
    )
