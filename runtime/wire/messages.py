"""Every message the actors exchange. The codec (`runtime.wire.codec`) carries them.

Hot messages (`StepPlan`, `StepResult`, `StepOutputs`) are columnar: one tuple per field, one
entry per sequence, so a step costs one message per direction whatever the batch size.

Control ops and their envelope are in `runtime.wire.control`; `ControlDone` answers them.

Tags are part of the protocol between processes: never reuse or renumber one. Retired: 13, 36.
Next free: 55.
"""

from __future__ import annotations

import runtime.wire.control  # noqa: F401 (registers the control ops with the codec)
from runtime.config.constraint import Constraint
from runtime.config.pooling import PoolingParams
from runtime.config.sampling import SamplingParams
from runtime.wire.codec import message, register
from runtime.wire.stats import SchedulerStats, WorkerStats  # fields here; actors import them

register(1)(SamplingParams)
register(53)(Constraint)  # SamplingParams.constraint
register(54)(PoolingParams)  # AddRequest.pooling, NewSeq.pooling


@message(2)
class AddRequest:
    """Frontend → scheduler: a new request with its prompt already tokenized.

    `max_tokens` is resolved by the frontend (`params.max_tokens`, or up to the context limit).
    With `pooling` the request is an embedding: its prompt is computed, pooled into one vector
    and the request ends; nothing is sampled (`max_tokens` is 1, `params` the defaults).
    """

    rid: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    params: SamplingParams
    session: str = ""  # the session whose turn it is ("" if none): its KV is kept at the end
    fork_of: str = ""  # a request of the same Submit with the same prompt, whose computed
    # prompt KV this one shares ("" if none): sample i > 0 of a request with n > 1
    pooling: PoolingParams | None = None  # an embedding request's, resolved by the frontend


@message(3)
class Submit:
    """Frontend → scheduler: everything the frontend queued since its last message."""

    adds: tuple[AddRequest, ...]
    aborts: tuple[str, ...]


@message(4)
class Ping:
    """Health probe, answered by a `Pong` with its nonce once every actor on the path saw it."""

    nonce: int


@message(6)
class Probe:
    """Frontend → scheduler: answered at once by the scheduler alone (a `Pong` without
    statistics), whatever its worker does: tells a hung worker from a hung scheduler."""

    nonce: int


@message(5)
class Pong:
    """Answer to `Ping`: each actor on the way back attaches its statistics."""

    nonce: int
    scheduler: SchedulerStats | None
    worker: WorkerStats | None


@message(10)
class NewSeq:
    """Scheduler → worker: a sequence the worker has no state for (new, or back from preemption)."""

    seq_id: int
    token_ids: tuple[int, ...]
    num_prompt_tokens: int
    num_computed_tokens: int
    params: SamplingParams
    pooling: PoolingParams | None = None  # an embedding: pooled, never sampled


@message(11)
class StepPlan:
    """Scheduler → worker: one engine step.

    `seq_ids[i]` computes its next `num_tokens[i]` tokens; a token is sampled for it when that
    reaches the end of its known tokens. `block_ids[j]` is appended to the block table of
    `block_seq_ids[j]`, in order. `released` sequences are gone: the worker drops their state.
    """

    step: int
    new_seqs: tuple[NewSeq, ...]
    seq_ids: tuple[int, ...]
    num_tokens: tuple[int, ...]
    block_seq_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    released: tuple[int, ...]
    queued: bool  # sent while an earlier step computed: the worker should find it waiting


@message(12)
class WorkerReady:
    """Worker → scheduler, once the model is loaded: what the worker actually runs."""

    num_kv_blocks: int
    dtype: str  # the torch dtype of weights and KV cache, e.g. "bfloat16"
    num_threads: int  # torch intra-op threads
    vocab_size: int  # token ids the model can embed: the scheduler refuses others
    tensor_parallel_size: int = 1  # ranks the model is split over, all of them started
    attention_backend: str = "torch"  # "cpp", "triton" or "torch": what attention runs on
    quantization: str = "none"  # matrices kept as GGUF blocks, e.g. "gguf (Q4_1 x120, Q8_0 x1)"
    step_weight_bytes: int = 0  # bytes of weights a decode step reads (linears and LM head)


@message(49)
class Logprobs:
    """Log-probabilities at consecutive positions of one sequence: of the token there, and of
    the `num_top` most likely tokens (most likely first)."""

    first_position: int
    token_logprobs: tuple[float, ...]  # empty for generated tokens: `StepResult.logprobs`
    num_top: int
    top_ids: tuple[int, ...]  # `num_top` per position
    top_logprobs: tuple[float, ...]


@message(14)
class StepResult:
    """Worker → scheduler: the token sampled for each sequence that finished its chunk.

    `top[i]` and `prompt[i]` belong to `seq_ids[i]`; both are empty tuples when no sequence
    of the step asked for them. `prompt[i]` comes with a sequence's first sampled token.
    An embedding sequence whose prompt this step finished is in `pooled_seq_ids` instead,
    its vector in `pooled` (little-endian float32, cut and normalized as it asked).
    """

    step: int
    seq_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    stats: WorkerStats  # as of the end of this step
    top: tuple[Logprobs | None, ...] = ()
    prompt: tuple[Logprobs | None, ...] = ()
    pooled_seq_ids: tuple[int, ...] = ()
    pooled: tuple[bytes, ...] = ()


@message(20)
class EngineReady:
    """Scheduler → frontend, once: the engine accepts requests, and this is what it runs."""

    max_model_len: int
    max_steps_in_flight: int
    worker: WorkerReady


@message(23)
class Rejected:
    """Scheduler → frontend: a request it would not take; it fails alone, the engine goes on."""

    rid: str
    reason: str


@message(22)
class StepOutputs:
    """Scheduler → frontend: every request's new token from one step (or only fresh stats).

    `finish_reasons[i]` is None while request `rids[i]` runs, else "stop" or "length".
    `num_cached_tokens[i]` is how many prompt tokens the prefix cache supplied.
    `embeddings[i]`, where not None, is embedding request `rids[i]`'s vector (it ends with
    "stop"; its token id is -1, a placeholder); `embeddings` is empty when the step finished
    no embedding request.
    """

    rids: tuple[str, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reasons: tuple[str | None, ...]
    num_cached_tokens: tuple[int, ...]
    scheduler: SchedulerStats
    worker: WorkerStats  # the latest the scheduler has
    top: tuple[Logprobs | None, ...] = ()  # as in StepResult, by `rids`
    prompt: tuple[Logprobs | None, ...] = ()
    embeddings: tuple[bytes | None, ...] = ()


# -- sessions: kept in order with the requests of their turns ---------------------------


@message(44)
class OpenSession:
    """Frontend → scheduler: keep the KV of this session's turns (`AddRequest.session`) as
    they end, until `ReleaseTurns` says otherwise."""

    session: str


@message(45)
class ReleaseTurns:
    """Frontend → scheduler: stop keeping the KV of these turns (by request id) of a
    session; with `close`, of all its turns, and forget the session."""

    session: str
    rids: tuple[str, ...]
    close: bool


# Tensor-parallel rank 0 → the other ranks of its model, broadcast over their process group
# (runtime/worker/tp_group.py), never over nng.


@message(50)
class ShardStep:
    """One step for the other tensor-parallel ranks: the plan rank 0 received, the tokens
    rank 0 sampled in the step before (the others do not sample, so their tables learn them
    here), and the rows whose logits rank 0 wants gathered."""

    plan: StepPlan
    sampled_seq_ids: tuple[int, ...]
    sampled_token_ids: tuple[int, ...]
    logit_rows: tuple[int, ...]


@message(51)
class StopShards:
    """The other tensor-parallel ranks exit: rank 0 is stopping."""
