"""In-memory links and a model-free worker, to test the scheduler actor deterministically.

`memory_pipe()` gives the two ends of a duplex link that speaks the real codec over trio memory
channels: no sockets, no threads, so trio's `autojump_clock` and `wait_all_tasks_blocked` see
everything. `fake_worker` speaks the worker's protocol with the worker's real `SeqTable`; the
token it samples is a function of the sequence's tokens so far (`next_token`), so a test knows
every request's output in advance.

Nothing here imports torch: the import-rule tests run the scheduler actor with it.
"""

from __future__ import annotations

import math
import struct

import trio

from runtime.config.engine import EngineConfig
from runtime.scheduler.actor import SchedulerActor
from runtime.wire.codec import decode, encode
from runtime.wire.control import Control, ControlDone, ReleaseMemory, ResumeMemory, UpdateWeights
from runtime.wire.messages import Ping, Pong, StepPlan, StepResult, WorkerReady, WorkerStats
from runtime.wire.transport import MessageChannel
from runtime.worker.seq_table import SeqTable

VOCAB = 50


class MemoryChannel(MessageChannel):
    def __init__(
        self, send: trio.MemorySendChannel[bytes], receive: trio.MemoryReceiveChannel[bytes]
    ) -> None:
        self._send, self._receive = send, receive

    async def send(self, msg: object) -> None:
        await self._send.send(encode(msg))

    async def recv(self) -> object:
        return decode(await self._receive.receive())


def memory_pipe(buffer: int = 64) -> tuple[MemoryChannel, MemoryChannel]:
    a_send, b_receive = trio.open_memory_channel[bytes](buffer)
    b_send, a_receive = trio.open_memory_channel[bytes](buffer)
    return MemoryChannel(a_send, a_receive), MemoryChannel(b_send, b_receive)


def start_actors(
    nursery: trio.Nursery,
    config: EngineConfig,
    eos_token_ids: frozenset[int],
    num_kv_blocks: int,
    hang_after: float = math.inf,
) -> MemoryChannel:
    """The real scheduler actor and the model-free worker; returns the frontend's end."""
    frontend, scheduler_frontend = memory_pipe()
    worker, scheduler_worker = memory_pipe()
    actor = SchedulerActor(config, eos_token_ids)
    nursery.start_soon(actor.run, scheduler_frontend, scheduler_worker)
    nursery.start_soon(fake_worker, worker, num_kv_blocks, hang_after)
    return frontend


def next_token(token_ids: list[int], weights: int = 0) -> int:
    """The fake model: `weights` counts the weight updates it has had."""
    return hash((*token_ids, -weights) if weights else tuple(token_ids)) % VOCAB  # stable


def fake_vector(token_ids: list[int]) -> bytes:
    """The fake model's embedding of a prompt: its length and its last token (float32)."""
    return struct.pack("<2f", len(token_ids), token_ids[-1])


def expected_output(
    prompt: list[int], max_tokens: int, eos: int | frozenset[int] | None = None, weights: int = 0
) -> list[int]:
    """The tokens `fake_worker` produces for `prompt`, up to an EOS or `max_tokens`."""
    stops = {eos} if isinstance(eos, int) else set(eos or ())
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens, weights))
        if tokens[-1] in stops:
            break
    return tokens[len(prompt) :]


async def fake_worker(
    scheduler: MessageChannel, num_kv_blocks: int, hang_after: float = math.inf
) -> None:
    """The worker's protocol without a model; after `hang_after` steps it stops answering
    (alive, not stepping: a hung GPU). A weight update from a path with "bad" in it fails;
    any other changes every later token (`next_token`'s `weights`)."""
    table = SeqTable()
    stats = WorkerStats()
    weights = 0
    await scheduler.send(WorkerReady(num_kv_blocks, "float32", 1, VOCAB))
    while True:
        msg = await scheduler.recv()
        match msg:
            case StepPlan() if stats.num_steps >= hang_after:
                await trio.sleep_forever()
            case StepPlan():
                seq_ids, token_ids, pooled_ids, pooled = [], [], [], []
                seqs = table.apply(msg)
                for seq_id, seq, n in zip(msg.seq_ids, seqs, msg.num_tokens, strict=True):
                    token = None
                    if seq.pooling is not None and SeqTable.samples(seq, n):
                        pooled_ids.append(seq_id)
                        pooled.append(fake_vector(seq.token_ids))
                    elif SeqTable.samples(seq, n):
                        token = next_token(seq.token_ids, weights)
                        seq_ids.append(seq_id)
                        token_ids.append(token)
                    SeqTable.commit(seq, n, token)
                stats = WorkerStats(num_steps=stats.num_steps + 1)
                logprobs = (-1.0,) * len(seq_ids)
                await scheduler.send(
                    StepResult(
                        msg.step,
                        tuple(seq_ids),
                        tuple(token_ids),
                        logprobs,
                        stats,
                        (),
                        (),
                        tuple(pooled_ids),
                        tuple(pooled),
                    )
                )
            case Ping(nonce=nonce):
                await scheduler.send(Pong(nonce, None, stats))
            case Control(nonce=nonce, op=ReleaseMemory() | ResumeMemory()):
                await scheduler.send(ControlDone(nonce, ""))
            case Control(nonce=nonce, op=UpdateWeights(model_path=path)):
                weights += "bad" not in path
                error = "CheckpointError: no such checkpoint" if "bad" in path else ""
                await scheduler.send(ControlDone(nonce, error))
            case _:
                raise AssertionError(f"the worker got {msg!r}")
