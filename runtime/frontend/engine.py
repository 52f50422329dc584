"""The frontend actor and the async engine API (`runtime.frontend.launch` starts it).

    async with open_engine(EngineConfig(model="path/to/checkpoint")) as engine:
        async for out in engine.generate("Hello", SamplingParams(max_tokens=16)):
            print(out.text, end="")

A request lives in the task that iterates `generate`. Cancel that task, or stop iterating, and
the request is aborted exactly once: its `finally` puts the abort in the outbox, a synchronous
call that no cancellation can interrupt, and the sender task delivers it with the next `Submit`.

The actors know a request by an id the engine makes (its `generate` call's number), never by
the caller's `rid`: that is a label, unique among open requests, and free again once its
request has ended, even while the scheduler is still finishing with the old one.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

import trio
from transformers import PreTrainedTokenizerBase

from runtime.checkpoints.model_info import ModelInfo
from runtime.config.engine import EngineConfig
from runtime.config.sampling import SamplingParams
from runtime.frontend.calls import Answer, Calls
from runtime.frontend.data_parallel import DataParallelChannel
from runtime.frontend.inputs import InputProcessor
from runtime.frontend.loads import LoadReports, ThroughputMeter
from runtime.frontend.outbox import Outbox
from runtime.frontend.profiling import ProfileCalls
from runtime.frontend.request_group import RequestGroup
from runtime.frontend.request_stream import RequestStream, dispatch
from runtime.frontend.sessions import SessionCalls, Sessions, SessionTurn
from runtime.frontend.steering import Steering
from runtime.frontend.steering_calls import SteeringCalls
from runtime.protocol import (
    EngineClient,
    EngineDeadError,
    EngineStats,
    FrontendStats,
    ModelCard,
    RequestOutput,
    RequestTimeoutError,
    SessionParams,
)
from runtime.tracing import PhaseTrace
from runtime.wire.codec import WireError
from runtime.wire.messages import (
    AddRequest,
    ControlDone,
    EngineReady,
    Ping,
    Pong,
    Probe,
    Rejected,
    SchedulerStats,
    StepOutputs,
    WeightValues,
    WorkerStats,
)
from runtime.wire.transport import MessageChannel

# Seconds the scheduler gets to answer a probe of its own: it answers at once when alive.
DIAGNOSE_TIMEOUT = 2.0


class Engine(SteeringCalls, SessionCalls, ProfileCalls, LoadReports, EngineClient):
    def __init__(
        self,
        config: EngineConfig,
        info: ModelInfo,
        tokenizer: PreTrainedTokenizerBase,
        processes: dict[str, trio.Process] | None = None,
        groups: DataParallelChannel | None = None,
    ) -> None:
        self.config = config
        self.info = info
        self.inputs = InputProcessor(tokenizer, info.vocab_size, config, info.eos_token_ids)
        self.processes = processes or {}  # actor processes by role (process mode)
        self._groups = groups  # with data parallelism: the channel to every group
        self.ready: EngineReady | None = None  # what the actors run, once `run` has started
        self._outbox = Outbox()
        self._streams: dict[str, RequestStream] = {}  # by the engine's own request id
        self._labels: dict[str, list[str]] = {}  # the caller's rid -> the engine's ids (one
        # per sample), while open
        self._no_requests = trio.Event()
        self._no_requests.set()
        self._call_order = itertools.count()
        self._calls = Calls(self._outbox)  # pings and control messages awaiting an answer
        self.steering = Steering(self, config.model, config.data_parallel_size)
        self.sessions = Sessions(config.max_sessions)
        self.trace = PhaseTrace("frontend")  # while profiling (start_profile)
        # generated tokens per second of each data-parallel group, for get_loads
        self._meters = [ThroughputMeter() for _ in range(config.data_parallel_size)]
        self._sessions_changed = trio.Event()
        self._dead: BaseException | None = None
        self._prompt_tokens = 0
        self._dispatch_seconds = 0.0
        self._detokenize_seconds = 0.0
        self._scheduler_stats = SchedulerStats.idle(0)
        self._worker_stats = WorkerStats()

    async def run(
        self,
        channel: MessageChannel,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Wait for the actors' `EngineReady`, then carry messages both ways until cancelled."""
        ready = await channel.recv()
        if not isinstance(ready, EngineReady):
            raise WireError(f"expected EngineReady, got {type(ready).__name__}")
        self.ready = ready
        self._scheduler_stats = SchedulerStats.idle(ready.worker.num_kv_blocks)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._send_loop, channel)
                nursery.start_soon(self._receive_loop, channel)
                nursery.start_soon(self._reap_sessions)
                task_status.started()
        except BaseException as exc:  # callers waiting for an answer (shielded ones too) wake
            self.fail(EngineDeadError(f"the engine's message loop stopped: {exc!r}"))
            raise

    def fail(self, error: BaseException) -> None:
        """The engine is dead: every open request and health check ends with `error`."""
        self._dead = self._dead or error  # the first cause is the one to report
        for stream in self._streams.values():
            stream.fail(EngineDeadError(str(error)))
        self._calls.wake_all()

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.inputs.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    # -- EngineClient --------------------------------------------------------------------

    @property
    def model_card(self) -> ModelCard:
        return ModelCard(
            self.steering.model_path,
            self.config.max_model_len,
            self.info.vocab_size,
            self.steering.weight_version,
        )

    def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        rid: str | None = None,
        timeout: float | None = None,
        session: SessionParams | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Generate from a prompt (text, or token ids); yields outputs as tokens come.

        Raises ValueError for a bad prompt or parameters right away, before anything is
        queued; the iterator raises EngineDeadError if the engine stops mid-request.
        """
        params = params or SamplingParams()
        token_ids = self.inputs.prompt_token_ids(prompt)
        label = rid if rid is not None else uuid.uuid4().hex
        self.inputs.check_limits(params, session is not None)
        turn = None
        if session is not None:  # the prompt continues the session's history
            bos = self.inputs.tokenizer.bos_token_id
            token_ids, opened, parent = self.sessions.prompt(session, label, token_ids, bos)
            turn = (opened, session, parent)
        max_tokens = self.inputs.max_tokens(params, len(token_ids))
        params = self.inputs.resolve(params, len(token_ids))
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        self._check_label_free(label)
        order = next(self._call_order)
        key = turn[0].key if turn is not None else ""
        adds = [AddRequest(f"{order}", token_ids, max_tokens, params, key)]
        for i in range(1, params.n):  # each sample its own seed; the prompt's KV is shared
            seed = None if params.seed is None else (params.seed + i) % 2**64
            child = params.replace(seed=seed, prompt_logprobs=None)
            adds.append(AddRequest(f"{order}.{i}", token_ids, max_tokens, child, "", f"{order}"))
        return self._run(label, adds, order, timeout or math.inf, turn)

    def abort(self, rid: str) -> None:
        for request_id in self._labels.get(rid, ()):
            self._abort(request_id)

    def abort_all(self) -> None:
        for request_id in list(self._streams):
            self._abort(request_id)

    async def wait_no_requests(self) -> None:
        await self._no_requests.wait()

    async def check_health(self) -> None:
        await self._ping()

    async def diagnose(self) -> str:
        """Which actor is not answering, after a health check did not return in time."""
        with trio.move_on_after(DIAGNOSE_TIMEOUT):
            await self._ping(through_worker=False)
            return "the worker is not answering (the scheduler is)"
        return "the scheduler is not answering"

    def server_info(self) -> dict[str, Any]:
        settings = dataclasses.asdict(self.config)
        live = self.statistics().per_rank()[0].scheduler.max_num_seqs  # the same in each group
        settings["max_num_seqs"] = live or self.config.max_num_seqs
        if self.ready is not None:  # what the actors run, read back from them
            w = self.ready.worker
            settings |= {"num_kv_blocks": w.num_kv_blocks, "dtype": w.dtype,
                         "num_threads": w.num_threads,
                         "tensor_parallel_size": w.tensor_parallel_size,
                         "attention_backend": w.attention_backend,
                         "max_steps_in_flight": self.ready.max_steps_in_flight}  # fmt: skip
        return settings

    def statistics(self) -> EngineStats:
        frontend = FrontendStats(
            num_requests_open=len(self._streams),
            num_requests_generating=sum(
                not stream.upstream_done for stream in self._streams.values()
            ),
            prompt_tokens_total=self._prompt_tokens,
            dispatch_seconds=self._dispatch_seconds,
            detokenize_seconds=self._detokenize_seconds,
        )
        ranks = self._groups.ranks() if self._groups is not None else ()
        return EngineStats(frontend, self._scheduler_stats, self._worker_stats, ranks)

    async def fetch_statistics(self) -> EngineStats:
        """Fresh statistics: a round trip through both actors, after all earlier submissions."""
        answer = await self._ping()
        now = self.statistics()
        return dataclasses.replace(
            now, scheduler=answer.scheduler or now.scheduler, worker=answer.worker or now.worker
        )

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self.inputs.tokenize_async(text, add_special_tokens)

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        return await self.inputs.detokenize_async(token_ids)

    async def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        return await self.inputs.apply_chat_template_async(messages)

    def token_texts(self, token_ids: Sequence[int]) -> list[str]:
        return self.inputs.token_texts(token_ids)

    def token_bytes(self, token_ids: Sequence[int]) -> list[bytes]:
        return self.inputs.token_bytes(token_ids)

    # -- requests ------------------------------------------------------------------------

    async def _run(
        self,
        label: str,
        adds: list[AddRequest],
        order: int,
        time_limit: float,
        turn: SessionTurn | None,
    ) -> AsyncGenerator[RequestOutput, None]:
        self._check_alive()
        await trio.lowlevel.checkpoint_if_cancelled()  # already cancelled: queue nothing
        self._check_label_free(label)  # another request may have taken it since `generate`
        if turn is not None:
            self._start_turn(turn, label)
        output_ids: list[int] = []
        finish_reason = None
        group = RequestGroup(label, adds, self.inputs.tokenizer)
        for add, stream in zip(adds, group.streams, strict=True):
            self._streams[add.rid] = stream
            self._outbox.add(order, add)
        self._labels[label] = [add.rid for add in adds]
        if self._no_requests.is_set():  # a task waiting on the unset one must still be woken
            self._no_requests = trio.Event()
        self._prompt_tokens += len(adds[0].prompt_token_ids)
        deadline = trio.current_time() + time_limit
        try:
            while not group.finished:
                # the deadline is for the engine's work: output already made is handed over
                with trio.move_on_at(deadline if not group.upstream_done else math.inf) as waiting:
                    await group.wait()  # (a scope within one step: no yield)
                if waiting.cancelled_caught:
                    raise RequestTimeoutError(f"the request ran past its {time_limit:g} s timeout")
                outputs = group.take()
                for i, output in outputs:
                    output_ids += output.token_ids
                    finish_reason = output.finish_reason
                    if output.finished:  # a stop string may end it here: tell the actors now
                        self._abort_upstream(adds[i].rid, group.streams[i])
                for _, output in outputs:
                    yield output
        finally:
            self._detokenize_seconds += group.detokenize_seconds
            for add, stream in zip(adds, group.streams, strict=True):
                del self._streams[add.rid]
                self._abort_upstream(add.rid, stream)
            del self._labels[label]
            if turn is not None:
                self._end_turn(turn, label, adds[0], output_ids, finish_reason)
            if not self._streams:
                self._no_requests.set()

    def _abort(self, request_id: str) -> None:
        stream = self._streams[request_id]
        stream.end("abort")
        self._abort_upstream(request_id, stream)

    def _abort_upstream(self, request_id: str, stream: RequestStream) -> None:
        """Tell the scheduler to drop the request, unless it is done with it: exactly once."""
        if not stream.upstream_done:
            stream.upstream_done = True
            self._outbox.abort(request_id)

    def _check_label_free(self, label: str) -> None:
        if label in self._labels:
            raise ValueError(
                f"request id {label!r} is already in use by a request that has not ended"
            )

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError("the engine is not running") from self._dead

    # -- actor tasks ---------------------------------------------------------------------

    async def _ping(self, *, through_worker: bool = True) -> Pong:
        """A round trip through both actors (or to the scheduler only), after everything
        queued before it."""
        answer = await self.ask(Ping if through_worker else Probe)
        assert isinstance(answer, Pong)
        return answer

    async def control(self, make: Callable[[int], object]) -> None:
        """Send a control message (made from its nonce); ValueError if it failed."""
        answer = await self.ask(make)
        assert isinstance(answer, ControlDone)
        if answer.error:
            raise ValueError(answer.error)

    async def ask(self, make: Callable[[int], object]) -> Answer:
        self._check_alive()
        answer = await self._calls.ask(make)
        self._check_alive()  # woken by `fail`, not by an answer
        assert answer is not None
        return answer

    async def _send_loop(self, channel: MessageChannel) -> None:
        while True:
            for msg in await self._outbox.take():
                await channel.send(msg)

    async def _receive_loop(self, channel: MessageChannel) -> None:
        while True:
            msg = await channel.recv()
            match msg:
                case StepOutputs():
                    started = time.perf_counter()
                    self._scheduler_stats, self._worker_stats = msg.scheduler, msg.worker
                    dispatch(self._streams, msg)
                    ended = time.perf_counter()
                    self._dispatch_seconds += ended - started
                    if self.trace.on and msg.rids:
                        self.trace.span("dispatch", started, ended, tokens=len(msg.rids))
                        self.trace.step_done()
                case Rejected(rid=request_id, reason=reason):
                    stream = self._streams.get(request_id)
                    if stream is not None:
                        stream.upstream_done = True  # the scheduler holds nothing of it
                        stream.fail(ValueError(f"the request was refused: {reason}"))
                case Pong(nonce=nonce, scheduler=scheduler, worker=worker):
                    self._scheduler_stats = scheduler or self._scheduler_stats
                    self._worker_stats = worker or self._worker_stats
                    self._calls.answer(nonce, msg)
                case ControlDone(nonce=nonce) | WeightValues(nonce=nonce):
                    self._calls.answer(nonce, msg)
                case _:
                    raise WireError(f"frontend got an unexpected {type(msg).__name__}")
