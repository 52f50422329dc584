"""The frontend actor and the async engine API.

    async with open_engine(EngineConfig(model="path/to/checkpoint")) as engine:
        async for out in engine.generate("Hello", SamplingParams(max_tokens=16)):
            print(out.token_ids, out.finish_reason)

A request lives in the task that iterates `generate`. Cancel that task, or stop iterating, and the
request is aborted exactly once: its `finally` puts an abort in the outbox, a synchronous call that
no cancellation can interrupt, and the sender task delivers it with the next `Submit`.
"""

from __future__ import annotations

import itertools
import random
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from runtime.config import EngineConfig
from runtime.messages import (
    AddRequest,
    EngineReady,
    Ping,
    Pong,
    SchedulerStats,
    StepOutputs,
    Submit,
    WireError,
)
from runtime.model_info import ModelInfo, load_model_info, resolve_max_model_len
from runtime.request_stream import EngineDeadError, RequestOutput, RequestStream
from runtime.sampling_params import SamplingParams
from runtime.supervisor import start_actors
from runtime.transport import Channel


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine, as of the scheduler's latest message.

    Attributes:
        num_requests_running: sequences in the running batch.
        num_requests_waiting: sequences queued (new or preempted).
        num_requests_open: requests whose `generate` is still being iterated.
        kv_cache_usage: fraction of KV blocks held by sequences, 0 to 1.
        scheduler: the scheduler's full counters (steps, timings, preemptions...).
    """

    num_requests_running: int
    num_requests_waiting: int
    num_requests_open: int
    kv_cache_usage: float
    scheduler: SchedulerStats


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        info: ModelInfo,
        tokenizer: PreTrainedTokenizerBase,
        channel: Channel,
        ready: EngineReady,
    ) -> None:
        self.config = config
        self.info = info
        self.tokenizer = tokenizer
        self.max_model_len = ready.max_model_len
        self._channel = channel
        self._streams: dict[str, RequestStream] = {}
        self._pending_adds: dict[str, AddRequest] = {}
        self._pending_aborts: list[str] = []
        self._pending_pings: list[int] = []
        self._outbox_ready = trio.Event()
        self._pongs: dict[int, trio.Event] = {}
        self._nonces = itertools.count()
        self._dead: BaseException | None = None
        self.processes: dict[str, trio.Process] = {}  # actor processes by role (process mode)
        self._stats = SchedulerStats(
            0, 0, ready.num_kv_blocks, ready.num_kv_blocks, 0, 0, 0, 0, 0, 0.0, 0.0, 0.0, 0.0, 0.0
        )

    # -- public API ----------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        rid: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Generate from a prompt (text, or token ids); yields new tokens as they come.

        Raises ValueError for a bad prompt or parameters before anything is queued, and
        EngineDeadError if the engine stops while the request runs.
        """
        token_ids = self._tokenize(prompt)
        params = self._resolve_params(params or SamplingParams(), len(token_ids))
        rid = rid if rid is not None else uuid.uuid4().hex
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already in use")
        if self._dead is not None:
            raise EngineDeadError("the engine is not running") from self._dead
        await trio.lowlevel.checkpoint_if_cancelled()  # already cancelled: queue nothing
        stream = RequestStream(rid, len(token_ids))
        self._streams[rid] = stream
        self._pending_adds[rid] = AddRequest(rid, tuple(token_ids), params)
        self._outbox_ready.set()
        try:
            while True:
                output = await stream.next_output()
                yield output
                if output.finished:
                    return
        finally:
            del self._streams[rid]
            if not stream.finished:
                self._abort_nowait(rid)

    async def check_health(self) -> None:
        """Return once the scheduler and the worker have both answered a ping.

        Put a deadline around it (`trio.move_on_after`): a hung actor never answers.
        """
        await self._ping()

    async def fetch_statistics(self) -> EngineStats:
        """Fresh statistics: a round trip through both actors, after all earlier submissions."""
        await self._ping()
        return self.statistics()

    async def _ping(self) -> None:
        if self._dead is not None:
            raise EngineDeadError("the engine is not running") from self._dead
        nonce = next(self._nonces)
        answered = self._pongs[nonce] = trio.Event()
        self._pending_pings.append(nonce)  # via the outbox: after everything submitted so far
        self._outbox_ready.set()
        try:
            await answered.wait()
        finally:
            del self._pongs[nonce]

    def statistics(self) -> EngineStats:
        s = self._stats
        used = s.num_total_blocks - s.num_free_blocks
        return EngineStats(
            num_requests_running=s.num_running,
            num_requests_waiting=s.num_waiting,
            num_requests_open=len(self._streams),
            kv_cache_usage=used / s.num_total_blocks if s.num_total_blocks else 0.0,
            scheduler=s,
        )

    # -- request intake ------------------------------------------------------------------

    def _tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
            bad = [t for t in token_ids if not (type(t) is int and 0 <= t < self.info.vocab_size)]
            if bad:
                raise ValueError(
                    f"token ids must be ints in [0, {self.info.vocab_size}): {bad[:5]}"
                )
        if not token_ids:
            raise ValueError("the prompt is empty")
        return token_ids

    def _resolve_params(self, params: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise ValueError(
                f"the prompt has {num_prompt_tokens} tokens, but this model's context is "
                f"{self.max_model_len} tokens and at least one must be left to generate"
            )
        if params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens, but "
                f"{num_prompt_tokens + params.max_tokens} were requested ({num_prompt_tokens} in "
                f"the prompt, {params.max_tokens} to generate)"
            )
        return params.replace(
            max_tokens=params.max_tokens or room,
            seed=params.seed if params.seed is not None else random.getrandbits(63),
            stop=(),  # stop strings are matched on text, here in the frontend
        )

    def _abort_nowait(self, rid: str) -> None:
        if self._pending_adds.pop(rid, None) is None:  # never sent: nothing to abort
            self._pending_aborts.append(rid)
            self._outbox_ready.set()

    # -- actor tasks ---------------------------------------------------------------------

    async def _send_loop(self) -> None:
        while True:
            await self._outbox_ready.wait()
            self._outbox_ready = trio.Event()
            adds, self._pending_adds = tuple(self._pending_adds.values()), {}
            aborts, self._pending_aborts = tuple(self._pending_aborts), []
            pings, self._pending_pings = self._pending_pings, []
            if adds or aborts:
                await self._channel.send(Submit(adds, aborts))
            for nonce in pings:
                await self._channel.send(Ping(nonce))

    async def _receive_loop(self) -> None:
        while True:
            msg = await self._channel.recv()
            match msg:
                case StepOutputs():
                    self._dispatch(msg)
                case Pong(nonce=nonce, stats=stats):
                    if stats is not None:
                        self._stats = stats
                    if nonce in self._pongs:
                        self._pongs[nonce].set()
                case _:
                    raise WireError(f"frontend got an unexpected {type(msg).__name__}")

    def _dispatch(self, msg: StepOutputs) -> None:
        self._stats = msg.stats
        streams = self._streams
        for rid, token_id, logprob, reason, cached in zip(
            msg.rids,
            msg.token_ids,
            msg.logprobs,
            msg.finish_reasons,
            msg.num_cached_tokens,
            strict=True,
        ):
            stream = streams.get(rid)
            if stream is not None:  # else: aborted by its consumer while the step ran
                stream.push(token_id, logprob, reason, cached)

    def _fail_all(self, error: BaseException) -> None:
        self._dead = error
        for stream in self._streams.values():
            stream.fail(EngineDeadError(str(error)))


@asynccontextmanager
async def open_engine(config: EngineConfig, *, progress: bool = False) -> AsyncIterator[Engine]:
    """Start the scheduler and worker actors (processes or tasks, per `config.mode`)."""
    info = load_model_info(config)
    config = config.replace(max_model_len=resolve_max_model_len(config, info))
    tokenizer = await trio.to_thread.run_sync(AutoTokenizer.from_pretrained, config.model)
    async with trio.open_nursery() as nursery:
        channel, processes = await start_actors(nursery, config, info.eos_token_ids, progress)
        with channel:
            ready = await channel.recv()
            if not isinstance(ready, EngineReady):
                raise WireError(f"expected EngineReady, got {type(ready).__name__}")
            engine = Engine(config, info, tokenizer, channel, ready)
            engine.processes = processes
            nursery.start_soon(engine._send_loop)
            nursery.start_soon(engine._receive_loop)
            try:
                yield engine
            finally:
                engine._fail_all(EngineDeadError("the engine shut down"))
                nursery.cancel_scope.cancel()
