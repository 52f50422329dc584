"""A scripted `EngineClient` for fast tests of `api/` (the real engine has end-to-end tests)."""

from __future__ import annotations

import dataclasses
import math
import struct
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import trio

from runtime.frontend.loads import internal_state, load_entry
from runtime.protocol import (
    Constraint,
    Embedding,
    EngineClient,
    EngineStats,
    FieldError,
    FrontendStats,
    ModelCard,
    PoolingParams,
    RankStats,
    RequestOutput,
    RequestTimeoutError,
    SamplingParams,
    SchedulerStats,
    SessionParams,
    WorkerStats,
)
from tests.fake_control import FakeControl

WORDS = ["alpha ", "beta ", "gamma ", "delta ", "eps ", "zeta ", "eta ", "theta "]


@dataclass
class FakeEngine(EngineClient):
    """Each request yields one word per output until max_tokens (default 4); or, with
    `reply` set, that text in pieces of 3 characters, then stops (as a model's EOS)."""

    max_model_len: int = 64
    healthy: bool = True
    requests: list[tuple[object, SamplingParams, str]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    open: set[str] = field(default_factory=set)
    step: trio.Event | None = None  # if set, each output waits for it (tests pace streams)
    sessions: set[str] = field(default_factory=set)
    embedded: list[tuple[list[object], PoolingParams]] = field(default_factory=list)
    data_parallel_size: int = 1  # each group reports the same figures
    last_tools: list[dict[str, Any]] | None = None  # what the last chat was rendered with
    compiled: list[Constraint] = field(default_factory=list)
    reply: str | None = None
    control: FakeControl = field(init=False)
    weights: FakeControl = field(init=False)  # the same fake plays both parts

    def __post_init__(self) -> None:
        self.control = self.weights = FakeControl(self)

    @property
    def model_card(self) -> ModelCard:
        return ModelCard("/fake/model", self.max_model_len, 100, self.control.weight_version)

    async def compile_constraint(self, constraint: Constraint) -> None:
        """A source that says "invalid" does not compile."""
        await trio.lowlevel.checkpoint()
        if "invalid" in constraint.source:
            raise ValueError(f"the {constraint.kind} is invalid")
        self.compiled.append(constraint)

    def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        rid: str | None = None,
        timeout: float | None = None,
        session: SessionParams | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        params = params or SamplingParams()
        if session is not None and session.id not in self.sessions:
            raise ValueError(f"no open session {session.id!r}")
        token_ids = self._encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty")
        if len(token_ids) + (params.max_tokens or 1) > self.max_model_len:
            raise ValueError(f"this model's maximum context length is {self.max_model_len}")
        rid = rid or f"r{len(self.requests)}"
        self.requests.append((prompt, params, rid))
        return self._run(rid, len(token_ids), params, timeout)

    async def _run(
        self, rid: str, prompt_len: int, params: SamplingParams, limit: float | None = None
    ) -> AsyncGenerator[RequestOutput, None]:
        self.open.add(rid)
        done = False
        try:
            words = WORDS
            count = params.max_tokens or 4
            if self.reply is not None:
                words = [self.reply[i : i + 3] for i in range(0, len(self.reply), 3)]
                count = min(count, len(words)) if params.max_tokens else len(words)
            for i in range(count):
                if self.step is not None:
                    with trio.move_on_after(limit or math.inf) as waiting:
                        await self.step.wait()
                    if waiting.cancelled_caught:
                        raise RequestTimeoutError("the request ran past its timeout")
                await trio.lowlevel.checkpoint()
                word = words[i % len(words)]
                stop = next((s for s in params.stop if s in word), None)
                if stop is not None:
                    done = True
                    out = self._output(rid, [i], word[: word.index(stop)], "stop", stop, prompt_len)
                    for sample in self._samples(out, params):
                        yield sample
                    return
                reason = None
                if i == count - 1:
                    whole = self.reply is not None and count == len(words)
                    reason = "stop" if whole else "length"
                done = reason is not None
                for sample in self._samples(
                    self._output(rid, [i], word, reason, None, prompt_len), params
                ):
                    yield sample
        finally:
            self.open.discard(rid)
            (self.finished if done else self.aborted).append(rid)

    @staticmethod
    def _output(
        rid: str,
        ids: list[int],
        text: str,
        reason: str | None,
        matched: str | int | None,
        prompt_len: int,
    ) -> RequestOutput:
        return RequestOutput(rid, ids, [-0.5] * len(ids), text, reason, matched, prompt_len, 0)

    @staticmethod
    def _samples(out: RequestOutput, params: SamplingParams) -> list[RequestOutput]:
        """The same output for each of the `n` samples, with top log-probabilities if asked."""
        top = [((t, -0.5),) for t in out.token_ids] if params.logprobs is not None else None
        return [dataclasses.replace(out, index=i, top_logprobs=top) for i in range(params.n)]

    async def embed(
        self,
        inputs: Sequence[str | Sequence[int]],
        params: PoolingParams | None = None,
        *,
        add_special_tokens: bool = True,
        rid: str | None = None,
    ) -> list[Embedding]:
        """Vectors of 4 values made from the tokens (`dimensions` cuts them, up to 4)."""
        params = params or PoolingParams()
        if params.dimensions is not None and params.dimensions > 4:
            raise FieldError("dimensions", "this model does not support matryoshka representation")
        out = []
        for i, item in enumerate(inputs):
            ids = self._encode(item) if isinstance(item, str) else list(item)
            if any(t >= 100 for t in ids):
                raise FieldError(f"inputs[{i}]", "token ids must be ints in [0, 100)")
            if len(ids) > self.max_model_len and params.truncate_prompt_tokens is None:
                raise FieldError(f"inputs[{i}]", "This model's maximum context length is 64")
            vector = [float(len(ids)), float(sum(ids) % 7), 1.0, 0.5][: params.dimensions or 4]
            data = struct.pack(f"<{len(vector)}f", *vector)
            out.append(Embedding(i, data, len(ids), 0))
        self.embedded.append((list(inputs), params))
        await trio.lowlevel.checkpoint()
        return out

    def abort(self, rid: str) -> bool:
        self.aborted.append(rid)
        return rid in self.open

    def abort_all(self) -> int:
        return len(self.open)

    async def wait_no_requests(self) -> None:
        await trio.lowlevel.checkpoint()

    def open_session(
        self,
        capacity_of_str_len: int,
        session_id: str | None = None,
        timeout: float | None = None,
    ) -> str:
        session_id = session_id or f"s{len(self.sessions)}"
        if session_id in self.sessions:
            raise ValueError(f"session {session_id!r} is already open")
        self.sessions.add(session_id)
        return session_id

    def close_session(self, session_id: str) -> None:
        if session_id not in self.sessions:
            raise ValueError(f"no open session {session_id!r}")
        self.sessions.remove(session_id)

    def get_loads(self) -> list[dict[str, Any]]:
        return [load_entry(rank, 16, 0.0) for rank in self.statistics().per_rank()]

    def get_internal_state(self) -> list[dict[str, Any]]:
        return [internal_state(load) for load in self.get_loads()]

    def server_info(self) -> dict[str, Any]:
        return {"model": "/fake/model", "max_num_seqs": self.control.max_num_seqs, "block_size": 16}

    async def check_health(self) -> str:
        if not self.healthy:
            await trio.sleep_forever()
        await trio.lowlevel.checkpoint()
        return ""

    async def diagnose(self) -> str:
        await trio.lowlevel.checkpoint()
        return "the worker is not answering (the scheduler is)"

    async def fetch_statistics(self) -> EngineStats:
        await trio.lowlevel.checkpoint()
        return self.statistics()

    def statistics(self) -> EngineStats:
        frontend = FrontendStats(
            num_requests_open=len(self.open),
            num_requests_generating=len(self.open),
            prompt_tokens_total=7,
            dispatch_seconds=0.0,
            detokenize_seconds=0.0,
        )
        scheduler = dataclasses.replace(
            SchedulerStats.idle(100),
            num_running=len(self.open),
            num_free_blocks=90,
            num_generated_tokens=11,
            num_cached_tokens=2,
            max_num_seqs=self.control.max_num_seqs,
        )
        ranks = tuple(
            RankStats(g, scheduler, WorkerStats(), 7) for g in range(self.data_parallel_size)
        )
        return EngineStats(frontend, scheduler, WorkerStats(), ranks)

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        await trio.lowlevel.checkpoint()
        text.encode()  # a lone surrogate is a ValueError, as in the engine
        return self._encode(text)

    @staticmethod
    def _encode(text: str) -> list[int]:
        return [ord(c) % 100 for c in text]

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        await trio.lowlevel.checkpoint()
        if any(t >= 100 for t in token_ids):
            raise ValueError("token ids must be ints in [0, 100)")
        return "".join(chr(t + 32) for t in token_ids)

    def token_texts(self, token_ids: Sequence[int]) -> list[str]:
        return [chr(t + 32) for t in token_ids]

    def token_bytes(self, token_ids: Sequence[int]) -> list[bytes]:
        return [text.encode() for text in self.token_texts(token_ids)]

    async def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        template_kwargs: Mapping[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        await trio.lowlevel.checkpoint()
        self.last_tools = tools
        turns = (f"<{m['role']}{':' + m['name'] if 'name' in m else ''}>" for m in messages)
        return (
            "".join(t + (m["content"] or "") for t, m in zip(turns, messages, strict=True))
            + "<assistant>"
        )
