from __future__ import annotations

import msgpack
import pytest

from runtime.config.constraint import Constraint
from runtime.config.pooling import PoolingParams
from runtime.config.sampling import SamplingParams
from runtime.tracing import ProfileRequest
from runtime.wire.codec import _TAG_OF, WireError, decode, encode
from runtime.wire.control import (
    Configure,
    Control,
    ControlDone,
    FlushCache,
    GetWeights,
    JoinWeightGroup,
    LeaveWeightGroup,
    Pause,
    ReleaseMemory,
    Resume,
    ResumeMemory,
    StartProfile,
    StopProfile,
    UpdateWeights,
    UpdateWeightsFromFile,
    UpdateWeightsFromGroup,
)
from runtime.wire.messages import (
    AddRequest,
    EngineReady,
    Logprobs,
    NewSeq,
    OpenSession,
    Ping,
    Pong,
    Probe,
    Rejected,
    ReleaseTurns,
    SchedulerStats,
    ShardStep,
    StepOutputs,
    StepPlan,
    StepResult,
    StopShards,
    Submit,
    WorkerReady,
    WorkerStats,
)

# SamplingParams' fields after the first nine, at their defaults
NEW = msgpack.unpackb(encode(SamplingParams()))[10:]
LOGPROBS = Logprobs(7, (-0.25,), 2, (1, 9), (-0.25, -2.0))
PARAMS = SamplingParams(
    max_tokens=7,
    temperature=0.5,
    top_k=3,
    top_p=0.9,
    min_p=0.1,
    seed=2**63,
    ignore_eos=True,
    stop_token_ids=(5, 6),
    stop=("END",),
)
CONSTRAINT = Constraint("json", '{"type": "object"}', whitespace_pattern=" ?", strict=True)
STATS = SchedulerStats(1, 2, 3, 4, 5, 6, 7, 8, 9, 0.1, 0.2, 0.3, 10, 11, 12)
WORKER_STATS = WorkerStats(9, 0.1, 0.2, 0.3, 0.4, 0.05)
EXAMPLES = [
    PARAMS,
    CONSTRAINT,
    SamplingParams(n=2, constraint=CONSTRAINT),
    AddRequest("r1", (1, 2, 3), 7, PARAMS),
    Submit((AddRequest("r1", (1,), 1, SamplingParams()),), ("r0", "r2")),
    Submit((), ()),
    Ping(3),
    Probe(4),
    Pong(3, None, None),
    Pong(4, STATS, WORKER_STATS),
    NewSeq(1, (4, 5), 2, 0, PARAMS),
    StepPlan(9, (NewSeq(1, (4, 5), 2, 0, PARAMS),), (1, 2), (2, 1), (1, 1), (7, 8), (3,), True),
    WorkerReady(100, "bfloat16", 1, 4096),
    Rejected("r1", "a reason"),
    WORKER_STATS,
    StepResult(9, (1, 2), (10, 11), (-0.5, -1.0), WORKER_STATS),
    EngineReady(2048, 2, WorkerReady(100, "float32", 4, 32000, 2, "cpp")),
    STATS,
    StepOutputs(("a", "b"), (1, 2), (-0.1, -0.2), (None, "stop"), (0, 16), STATS, WORKER_STATS),
    StepResult(3, (1, 2), (10, 11), (-0.5, -1.0), WORKER_STATS, (LOGPROBS, None), (None, LOGPROBS)),
    AddRequest("r1.1", (1, 2), 7, PARAMS, "", "r1"),
    LOGPROBS,
    SamplingParams(
        n=3,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        logit_bias=((5, -100.0), (6, 2.5)),
        min_tokens=2,
        bad_words=("no",),
        bad_words_token_ids=((1, 2), (3,)),
        allowed_token_ids=(1, 2, 3),
        logprobs=5,
        prompt_logprobs=0,
        prompt_logprobs_start=4,
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
        include_stop_str_in_output=True,
    ),
    AddRequest("\ud800", (1,), 1, SamplingParams(stop=("\udfff",))),  # lone surrogates from JSON
    Pause("keep"),
    Resume(),
    Control(6, Resume()),
    FlushCache(True),
    UpdateWeights("/path/to/checkpoint"),
    Control(8, UpdateWeights("/path/to/checkpoint")),
    JoinWeightGroup("trainer", "127.0.0.1", 29500, 1, 2, "gloo"),
    UpdateWeightsFromGroup("trainer", ("a", "b"), ("bfloat16", "float32"), ((2, 3), ())),
    LeaveWeightGroup("trainer"),
    Configure(64),
    OpenSession("s1"),
    ReleaseTurns("s1", ("3", "4"), False),
    StartProfile(ProfileRequest("/tmp/traces", 5, ("CPU",), True, False)),
    Control(17, StartProfile(ProfileRequest("/tmp/traces", 5, ("CPU",), True, False))),
    ProfileRequest("/tmp/t", 0, ("CPU", "GPU"), False, True),
    StopProfile(),
    UpdateWeightsFromFile("/tmp/weights.safetensors"),
    GetWeights("model.embed_tokens.weight", 100),
    ControlDone(9, "", (0.5, -1.25)),
    ControlDone(10, "the model has no parameter 'x'"),
    ReleaseMemory(("kv_cache", "weights")),
    ResumeMemory(("weights",)),
    ControlDone(5, ""),
    ShardStep(StepPlan(9, (), (1,), (1,), (), (), (), False), (1, 2), (7, 8), (0, 3)),
    StopShards(),
    ControlDone(6, "the engine is already paused"),
    # embeddings: the request's pooling, the worker's vectors, the frontend's
    PoolingParams("mean", False, 64, -1),
    AddRequest("e.0", (1, 2), 1, SamplingParams(), pooling=PoolingParams("last")),
    NewSeq(2, (1, 2), 2, 0, SamplingParams(), PoolingParams("cls", True, None, 8)),
    StepResult(4, (), (), (), WORKER_STATS, (), (), (2,), (b"\x00\x00\x80?",)),
    StepOutputs(
        ("a", "e"),
        (7, -1),
        (-0.5, 0.0),
        (None, "stop"),
        (0, 16),
        STATS,
        WORKER_STATS,
        embeddings=(None, b"\x00\x00\x80?"),
    ),
]


def test_every_message_type_has_an_example() -> None:
    assert {type(m) for m in EXAMPLES} == set(_TAG_OF)


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: object) -> None:
    assert decode(encode(msg)) == msg


@pytest.mark.parametrize(
    ("wire", "error"),
    [
        (b"\xc1", "not a msgpack message"),
        (msgpack.packb({"tag": 4}), "expected \\[tag, fields...\\]"),
        (msgpack.packb([]), "expected \\[tag, fields...\\]"),
        (msgpack.packb([999, 1]), "unknown message tag 999"),
        (msgpack.packb([4]), "Ping: expected 1 fields, got 0"),
        (msgpack.packb([4, 1, 2]), "Ping: expected 1 fields, got 2"),
        (msgpack.packb([4, "1"]), "Ping.nonce: expected int, got str"),
        (msgpack.packb([4, True]), "Ping.nonce: expected int, got bool"),
        (
            msgpack.packb([2, "r", [1, "x"], 1, [1], "", "", None]),
            "prompt_token_ids\\[1\\]: expected int",
        ),
        (
            msgpack.packb([2, "r", [1], 1, [4, 1], "", "", None]),
            "AddRequest.params: expected SamplingParams",
        ),
        (msgpack.packb([1, 0, 1.0, 0, 1.0, 0.0, None, False, [], [], *NEW]), "max_tokens must be"),
        (msgpack.packb([1, None, "hot", 0, 1.0, 0.0, None, False, [], [], *NEW]), "temperature: e"),
        (msgpack.packb([53, "json", 7, False, None, False]), "Constraint.source: expected str"),
        (msgpack.packb([53, "lisp", "x", False, None, False]), "Constraint: constraint kind"),
        (
            msgpack.packb([1, None, 1.0, 0, 1.0, 0.0, None, False, [], [], *NEW[:-1], [4, 1]]),
            "SamplingParams.constraint: expected Constraint",
        ),
        (msgpack.packb([3, [], "abc"]), "Submit.aborts: expected a list"),
        (msgpack.packb([52, 1, [4, 1]]), "Control.op: expected a ControlOp, got list"),
        (msgpack.packb([52, 1, [999]]), "Control.op: expected a ControlOp"),
        (msgpack.packb([52, 1, [30, 7]]), "Pause.mode: expected str, got int"),
        (msgpack.packb([54, "max", True, None, None]), "pooling_type: must be one of"),
    ],
)
def test_malformed_input_is_rejected_with_a_clear_error(wire: bytes, error: str) -> None:
    with pytest.raises(WireError, match=error):
        decode(wire)


def test_unregistered_objects_cannot_be_encoded() -> None:
    with pytest.raises(TypeError, match="not a registered message"):
        encode(Ping(object()))  # type: ignore[arg-type]


def test_a_control_op_declares_its_route() -> None:
    """Relays forward by what an op's class declares, never by its name."""
    join = JoinWeightGroup("trainer", "127.0.0.1", 29500, 1, 4, "gloo")
    assert join.for_group(2) == JoinWeightGroup("trainer", "127.0.0.1", 29500, 3, 4, "gloo")
    assert Pause("keep").for_group(1) == Pause("keep")
    assert UpdateWeights("/x").changes_weights and not GetWeights("w", 1).changes_weights
