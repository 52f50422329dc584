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
from collections.abc import AsyncGenerator, Mapping, Sequence
from typing import Any

import trio
from transformers import PreTrainedTokenizerBase

from runtime.checkpoints.model_info import ModelInfo
from runtime.config.constraint import Constraint
from runtime.config.engine import EngineConfig
from runtime.config.pooling import PoolingParams
from runtime.config.sampling import SamplingParams
from runtime.frontend.calls import Calls
from runtime.frontend.constraints import ConstraintCompiler
from runtime.frontend.control import EngineControl
from runtime.frontend.data_parallel import DataParallelChannel
from runtime.frontend.embeddings import EmbeddingCall, EmbeddingInputs
from runtime.frontend.inputs import InputProcessor
from runtime.frontend.loads import LoadReports
from runtime.frontend.open_requests import OpenRequests
from runtime.frontend.outbox import Outbox
from runtime.frontend.request_group import RequestGroup
from runtime.frontend.request_stream import dispatch
from runtime.frontend.sessions import Sessions, SessionTurn
from runtime.frontend.weight_sources import ServedVersion
from runtime.frontend.weights import WeightUpdates
from runtime.protocol import (
    Embedding,
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
from runtime.wire.control import ControlDone
from runtime.wire.messages import (
    AddRequest,
    EngineReady,
    Pong,
    Rejected,
    SchedulerStats,
    StepOutputs,
    WorkerStats,
)
from runtime.wire.transport import MessageChannel


class Engine(EngineClient):
    """Requests, their text and the engine's statistics; its parts: `requests` (the open
    ones), `sessions`, `loads` (load reports), `control` (the `ControlClient`: pause, memory,
    profiles) and `weights` (the `WeightsClient`: updates, reads, version)."""

    control: EngineControl
    weights: WeightUpdates

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
        self.constraints = ConstraintCompiler(tokenizer, info.vocab_size, info.eos_token_ids)
        self.embedding_inputs = EmbeddingInputs(
            self.inputs, info.hf_config, config.pooling, config.max_model_len
        )
        self.processes = processes or {}  # actor processes by role (process mode)
        self._groups = groups  # with data parallelism: the channel to every group
        self.ready: EngineReady | None = None  # what the actors run, once `run` has started
        self._outbox = Outbox()
        self._call_order = itertools.count()
        self._calls = Calls(self._outbox)  # pings and control ops awaiting an answer
        self.trace = PhaseTrace("frontend")  # while profiling (start_profile)
        self.requests = OpenRequests(self._outbox)
        self.sessions = Sessions(config.max_sessions, self._outbox)
        self.loads = LoadReports(config.block_size, config.data_parallel_size)
        served = ServedVersion(config.model)
        self.control = EngineControl(self._calls, self.requests, self.trace, served)
        self.weights = WeightUpdates(
            self._calls, self.control, self.requests, served, config.data_parallel_size
        )
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
                nursery.start_soon(self.sessions.reap)
                task_status.started()
        except BaseException as exc:  # callers waiting for an answer (shielded ones too) wake
            self.fail(EngineDeadError(f"the engine's message loop stopped: {exc!r}"))
            raise

    def fail(self, error: BaseException) -> None:
        """The engine is dead: every open request and health check ends with `error`."""
        self.requests.fail(error)
        self._calls.fail(error)

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.inputs.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    # -- EngineClient --------------------------------------------------------------------

    @property
    def model_card(self) -> ModelCard:
        served = self.weights.served
        return ModelCard(
            served.model_path, self.config.max_model_len, self.info.vocab_size,
            served.weight_version,
        )  # fmt: skip

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
        queued (for a structured-output constraint not compiled yet, `compile_constraint`,
        as the iteration starts); the iterator raises EngineDeadError if the engine stops
        mid-request.
        """
        params = params or SamplingParams()
        token_ids = self.inputs.prompt_token_ids(prompt)
        label = rid if rid is not None else uuid.uuid4().hex
        self.inputs.check_limits(params, session is not None)
        turn = None
        if session is not None:  # the prompt continues the session's history
            bos = self.inputs.tokenizer.bos_token_id
            token_ids, turn = self.sessions.prompt(session, label, token_ids, bos)
        max_tokens = self.inputs.max_tokens(params, len(token_ids))
        params = self.inputs.resolve(params, len(token_ids))
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        self.requests.check_label_free(label)
        order = next(self._call_order)
        key = turn[0].key if turn is not None else ""
        adds = [AddRequest(f"{order}", token_ids, max_tokens, params, key)]
        for i in range(1, params.n):  # each sample its own seed; the prompt's KV is shared
            seed = None if params.seed is None else (params.seed + i) % 2**64
            child = params.replace(seed=seed, prompt_logprobs=None)
            adds.append(AddRequest(f"{order}.{i}", token_ids, max_tokens, child, "", f"{order}"))
        return self._run(label, adds, order, timeout or math.inf, turn)

    async def compile_constraint(self, constraint: Constraint) -> None:
        await self.constraints.compile(constraint)

    async def embed(
        self,
        inputs: Sequence[str | Sequence[int]],
        params: PoolingParams | None = None,
        *,
        add_special_tokens: bool = True,
        rid: str | None = None,
    ) -> list[Embedding]:
        """One vector per input, in input order (see `EngineClient.embed`)."""
        params = self.embedding_inputs.resolve(params or PoolingParams())
        prompts = await self.embedding_inputs.token_ids(inputs, params, add_special_tokens)
        label = rid if rid is not None else uuid.uuid4().hex
        self._calls.check_alive()
        await trio.lowlevel.checkpoint_if_cancelled()  # already cancelled: queue nothing
        self.requests.check_label_free(label)
        order = next(self._call_order)
        call = EmbeddingCall(order, prompts, params)
        self.requests.open(label, order, call.adds, call.streams)
        self._prompt_tokens += sum(len(ids) for ids in prompts)
        try:
            return await call.results()
        finally:
            self.requests.close(label, call.adds)

    def abort(self, rid: str) -> bool:
        return self.requests.abort(rid)

    def abort_all(self) -> int:
        return self.requests.abort_all()

    async def wait_no_requests(self) -> None:
        await self.requests.wait_none()

    async def check_health(self) -> str:
        # with several groups, one group's output proves that group alone
        return await self._calls.health(self.control.busy, self.config.data_parallel_size == 1)

    async def diagnose(self) -> str:
        return await self._calls.diagnose()

    def server_info(self) -> dict[str, Any]:
        settings = dataclasses.asdict(self.config)
        settings["control_operation"] = self.control.busy or None
        live = self.statistics().per_rank()[0].scheduler.max_num_seqs  # the same in each group
        settings["max_num_seqs"] = live or self.config.max_num_seqs
        if self.ready is not None:  # what the actors run, read back from them
            w = self.ready.worker
            settings |= {"num_kv_blocks": w.num_kv_blocks, "dtype": w.dtype,
                         "num_threads": w.num_threads, "quantization": w.quantization,
                         "tensor_parallel_size": w.tensor_parallel_size,
                         "attention_backend": w.attention_backend, "step_weight_bytes":
                         w.step_weight_bytes, "max_steps_in_flight":
                         self.ready.max_steps_in_flight}  # fmt: skip
        return settings

    def statistics(self) -> EngineStats:
        frontend = FrontendStats(
            num_requests_open=len(self.requests),
            num_requests_generating=self.requests.num_generating,
            prompt_tokens_total=self._prompt_tokens,
            dispatch_seconds=self._dispatch_seconds,
            detokenize_seconds=self._detokenize_seconds,
        )
        ranks = self._groups.ranks() if self._groups is not None else ()
        return EngineStats(frontend, self._scheduler_stats, self._worker_stats, ranks)

    async def fetch_statistics(self) -> EngineStats:
        """Fresh statistics: a round trip through both actors, after all earlier submissions."""
        answer = await self._calls.ping()
        now = self.statistics()
        return dataclasses.replace(
            now, scheduler=answer.scheduler or now.scheduler, worker=answer.worker or now.worker
        )

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self.inputs.tokenize_async(text, add_special_tokens)

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        return await self.inputs.detokenize_async(token_ids)

    async def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        template_kwargs: Mapping[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        return await self.inputs.apply_chat_template_async(messages, template_kwargs, tools)

    def token_texts(self, token_ids: Sequence[int]) -> list[str]:
        return self.inputs.token_texts(token_ids)

    def token_bytes(self, token_ids: Sequence[int]) -> list[bytes]:
        return self.inputs.token_bytes(token_ids)

    def open_session(
        self,
        capacity_of_str_len: int,
        session_id: str | None = None,
        timeout: float | None = None,
    ) -> str:
        return self.sessions.open(capacity_of_str_len, session_id, timeout)

    def close_session(self, session_id: str) -> None:
        self.sessions.close(session_id)

    def get_loads(self) -> list[dict[str, Any]]:
        return self.loads.loads(self.statistics())

    def get_internal_state(self) -> list[dict[str, Any]]:
        return self.loads.internal_state(self.statistics())

    # -- requests ------------------------------------------------------------------------

    async def _run(
        self,
        label: str,
        adds: list[AddRequest],
        order: int,
        time_limit: float,
        turn: SessionTurn | None,
    ) -> AsyncGenerator[RequestOutput, None]:
        self._calls.check_alive()
        constraint = adds[0].params.constraint
        if constraint is not None:  # usually a cached verdict: the API compiled it already
            await self.constraints.compile(constraint)
        await trio.lowlevel.checkpoint_if_cancelled()  # already cancelled: queue nothing
        self.requests.check_label_free(label)  # another may have taken it since `generate`
        if turn is not None:
            self.sessions.start_turn(turn, label)
        output_ids: list[int] = []
        finish_reason = None
        group = RequestGroup(label, adds, self.inputs.tokenizer)
        self.requests.open(label, order, adds, group.streams)
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
                        self.requests.end_upstream(adds[i].rid, group.streams[i])
                for _, output in outputs:
                    yield output
        finally:
            self._detokenize_seconds += group.detokenize_seconds
            self.requests.close(label, adds)
            if turn is not None:
                self.sessions.end_turn(turn, label, adds[0], output_ids, finish_reason)

    # -- actor tasks ---------------------------------------------------------------------

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
                    self._calls.heard()
                    self._scheduler_stats, self._worker_stats = msg.scheduler, msg.worker
                    dispatch(self.requests.streams, msg)
                    ended = time.perf_counter()
                    self._dispatch_seconds += ended - started
                    if self.trace.on and msg.rids:
                        self.trace.span("dispatch", started, ended, tokens=len(msg.rids))
                        self.trace.step_done()
                case Rejected(rid=request_id, reason=reason):
                    self.requests.refused(request_id, reason)
                case Pong(nonce=nonce, scheduler=scheduler, worker=worker):
                    self._scheduler_stats = scheduler or self._scheduler_stats
                    self._worker_stats = worker or self._worker_stats
                    self._calls.answer(nonce, msg)
                case ControlDone(nonce=nonce):
                    self._calls.answer(nonce, msg)
                case _:
                    raise WireError(f"frontend got an unexpected {type(msg).__name__}")
