"""The frontend actor and the async engine API.

    async with open_engine(EngineConfig(model="path/to/checkpoint")) as engine:
        async for out in engine.generate("Hello", SamplingParams(max_tokens=16)):
            print(out.text, end="")

A request lives in the task that iterates `generate`. Cancel that task, or stop iterating, and
the request is aborted exactly once: its `finally` puts the abort in the outbox, a synchronous
call that no cancellation can interrupt, and the sender task delivers it with the next `Submit`.
"""

from __future__ import annotations

import itertools
import random
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import asynccontextmanager

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
from runtime.output_processor import OutputProcessor
from runtime.protocol import EngineClient, EngineStats, ModelCard
from runtime.request_stream import EngineDeadError, RequestOutput, RequestStream
from runtime.sampling_params import SamplingParams
from runtime.supervisor import ActorDiedError, OnDeath, start_actors
from runtime.transport import Channel

# Seconds the requests of a dead engine (and `on_actor_death`) get to report the error.
ACTOR_DEATH_GRACE = 5.0


class Engine(EngineClient):
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
        self.processes: dict[str, trio.Process] = {}  # actor processes by role (process mode)
        self._channel = channel
        self._streams: dict[str, RequestStream] = {}
        self._no_requests = trio.Event()
        self._no_requests.set()
        self._pending_adds: dict[str, tuple[int, AddRequest]] = {}  # rid -> (call order, add)
        self._call_order = itertools.count()
        self._pending_aborts: list[str] = []
        self._pending_pings: list[int] = []
        self._outbox_ready = trio.Event()
        self._pongs: dict[int, trio.Event] = {}
        self._nonces = itertools.count()
        self._dead: BaseException | None = None
        self._prompt_tokens = 0
        self._dispatch_seconds = 0.0
        self._detokenize_seconds = 0.0
        self._stats = SchedulerStats.idle(ready.num_kv_blocks)

    # -- EngineClient --------------------------------------------------------------------

    @property
    def model_card(self) -> ModelCard:
        return ModelCard(self.config.model, self.max_model_len, self.info.vocab_size)

    def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        rid: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Generate from a prompt (text, or token ids); yields outputs as tokens come.

        Raises ValueError for a bad prompt or parameters right away, before anything is
        queued; the iterator raises EngineDeadError if the engine stops mid-request.
        """
        token_ids = self._tokenize_prompt(prompt)
        params = self._resolve_params(params or SamplingParams(), len(token_ids))
        rid = rid if rid is not None else uuid.uuid4().hex
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already in use")
        return self._run(rid, token_ids, params, next(self._call_order))

    def abort(self, rid: str) -> None:
        stream = self._streams.get(rid)
        if stream is not None:
            stream.end("abort")
            self._abort_upstream(rid, stream)

    def abort_all(self) -> None:
        for rid in list(self._streams):
            self.abort(rid)

    async def wait_no_requests(self) -> None:
        await self._no_requests.wait()

    async def check_health(self) -> None:
        await self._ping()

    async def fetch_statistics(self) -> EngineStats:
        """Fresh statistics: a round trip through both actors, after all earlier submissions."""
        await self._ping()
        return self.statistics()

    def statistics(self) -> EngineStats:
        s = self._stats
        used = s.num_total_blocks - s.num_free_blocks
        return EngineStats(
            num_requests_running=s.num_running,
            num_requests_waiting=s.num_waiting,
            num_requests_open=len(self._streams),
            kv_cache_usage=used / s.num_total_blocks if s.num_total_blocks else 0.0,
            prompt_tokens_total=self._prompt_tokens,
            generation_tokens_total=s.num_generated_tokens,
            dispatch_seconds=self._dispatch_seconds,
            detokenize_seconds=self._detokenize_seconds,
            scheduler=s,
        )

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        text.encode()  # a lone surrogate (JSON allows "\ud800") is a UnicodeError, a ValueError
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def detokenize(self, token_ids: Sequence[int]) -> str:
        self._check_token_ids(token_ids)
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=False))

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template; use /v1/completions")
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:  # jinja errors from a template that rejects the messages
            raise ValueError(f"the chat template rejected the messages: {exc}") from None
        return str(text)

    # -- requests ------------------------------------------------------------------------

    async def _run(
        self, rid: str, token_ids: list[int], params: SamplingParams, order: int
    ) -> AsyncGenerator[RequestOutput, None]:
        if self._dead is not None:
            raise EngineDeadError("the engine is not running") from self._dead
        await trio.lowlevel.checkpoint_if_cancelled()  # already cancelled: queue nothing
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already in use")
        processor = OutputProcessor(rid, self.tokenizer, token_ids, params)
        stream = self._streams[rid] = RequestStream()
        self._no_requests = trio.Event()
        add = AddRequest(rid, tuple(token_ids), params.replace(stop=()))
        self._pending_adds[rid] = (order, add)
        self._prompt_tokens += len(token_ids)
        self._outbox_ready.set()
        try:
            while True:
                tokens = await stream.next_output()
                started = time.perf_counter()
                output = processor.process(tokens)
                self._detokenize_seconds += time.perf_counter() - started
                if output.finished:
                    stream.end(output.finish_reason or "stop")  # a stop string ends it here
                yield output
                if output.finished:
                    return
        finally:
            del self._streams[rid]
            self._abort_upstream(rid, stream)
            if not self._streams:
                self._no_requests.set()

    def _abort_upstream(self, rid: str, stream: RequestStream) -> None:
        """Tell the scheduler to drop `rid`, unless it is done with it: exactly once."""
        if stream.upstream_done:
            return
        stream.upstream_done = True
        if self._pending_adds.pop(rid, None) is None:  # never sent: nothing to abort
            self._pending_aborts.append(rid)
            self._outbox_ready.set()

    def _tokenize_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            token_ids = self.tokenize(prompt)
        else:
            token_ids = list(prompt)
            self._check_token_ids(token_ids)
        if not token_ids:
            raise ValueError("the prompt is empty")
        return token_ids

    def _check_token_ids(self, token_ids: Sequence[int]) -> None:
        vocab = self.info.vocab_size
        bad = [t for t in token_ids if not (type(t) is int and 0 <= t < vocab)]
        if bad:
            raise ValueError(f"token ids must be ints in [0, {vocab}), got {bad[:5]}")

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
        vocab = self.info.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be below the vocabulary size {vocab}")
        return params.replace(
            max_tokens=params.max_tokens or room,
            top_k=params.top_k if params.top_k < vocab else 0,  # all of them: keep all
            seed=params.seed if params.seed is not None else random.getrandbits(63),
        )

    # -- actor tasks ---------------------------------------------------------------------

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
        if self._dead is not None:  # woken by _fail_all, not by a Pong
            raise EngineDeadError("the engine is not running") from self._dead

    async def _send_loop(self) -> None:
        while True:
            await self._outbox_ready.wait()
            self._outbox_ready = trio.Event()
            # first come (first `generate` call), first served, whatever order tasks ran in
            adds = tuple(add for _, add in sorted(self._pending_adds.values()))
            self._pending_adds = {}
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
                    started = time.perf_counter()
                    self._dispatch(msg)
                    self._dispatch_seconds += time.perf_counter() - started
                case Pong(nonce=nonce, stats=stats):
                    if stats is not None:
                        self._stats = stats
                    if nonce in self._pongs:
                        self._pongs[nonce].set()
                case _:
                    raise WireError(f"frontend got an unexpected {type(msg).__name__}")

    def _dispatch(self, msg: StepOutputs) -> None:
        """Hand each request its token. Never waits: a slow consumer just gets tokens merged."""
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
            if stream is not None:  # else: abandoned by its consumer while the step ran
                stream.push(token_id, logprob, reason, cached)

    def _fail_all(self, error: BaseException) -> None:
        self._dead = self._dead or error  # the first cause is the one to report
        for stream in self._streams.values():
            stream.fail(EngineDeadError(str(error)))
        for answered in self._pongs.values():  # health checks waiting on a ping
            answered.set()


@asynccontextmanager
async def open_engine(
    config: EngineConfig, *, progress: bool = False, on_actor_death: OnDeath | None = None
) -> AsyncIterator[Engine]:
    """Start the scheduler and worker actors (processes or tasks, per `config.mode`).

    If an actor process dies, every request fails with EngineDeadError, `on_actor_death` (if
    given) is awaited, e.g. to let an HTTP server send those errors and stop, and then
    ActorDiedError cancels everything: within ACTOR_DEATH_GRACE seconds in all.
    """
    info = load_model_info(config)
    config = config.replace(max_model_len=resolve_max_model_len(config, info))
    tokenizer = await trio.to_thread.run_sync(AutoTokenizer.from_pretrained, config.model)
    engine: Engine | None = None

    async def report_death(error: ActorDiedError) -> None:
        """Shielded: even if the engine's user leaves meanwhile, the death is raised after."""
        if engine is None:
            return  # still starting: nobody to tell
        engine._fail_all(error)
        with trio.move_on_after(ACTOR_DEATH_GRACE, shield=True):
            await engine.wait_no_requests()
            if on_actor_death is not None:
                await on_actor_death(error)

    async with trio.open_nursery() as actors:
        channel, processes = await start_actors(
            actors, config, info.eos_token_ids, progress, report_death
        )
        with channel:  # closed only once the tasks using it have exited
            ready = await channel.recv()
            if not isinstance(ready, EngineReady):
                raise WireError(f"expected EngineReady, got {type(ready).__name__}")
            engine = Engine(config, info, tokenizer, channel, ready)
            engine.processes = processes
            async with trio.open_nursery() as frontend:
                frontend.start_soon(engine._send_loop)
                frontend.start_soon(engine._receive_loop)
                try:
                    yield engine
                finally:
                    engine._fail_all(EngineDeadError("the engine shut down"))
                    frontend.cancel_scope.cancel()
        actors.cancel_scope.cancel()
