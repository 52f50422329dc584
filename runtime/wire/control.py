"""Control ops: every call that steers the engine is data with a declared route.

The frontend sends one envelope, `Control(nonce, op)`, and gets one `ControlDone(nonce, error,
values)` back. The op's class says where it goes, so no relay needs to know it:

- `scope`: who applies it. SCHEDULER ops are answered by the scheduler
  (runtime/scheduler/control.py); WORKER ops by the worker, tensor-parallel rank 0 only;
  EVERY_RANK ops by every tensor-parallel rank in step, rank 0 answering for all
  (runtime/worker/control.py). The scheduler looks at every op first (it may refuse one, or
  do its own part of it, such as dropping its prefix cache with the KV pool) and forwards what
  is not its own.
- `fan_out`: with data parallelism, ALL groups apply it and their answers become one (an op
  that `changes_weights` must succeed in every group or in none); ONE_GROUP asks group 0 only
  (they serve the same weights). `for_group` adapts an op to a group (a trainer's rank offset).
- `runs`: where the worker runs it. BETWEEN_STEPS in the thread that runs steps, so it sees a
  whole step before and after; BESIDE_STEPS in a thread of its own while steps go on (a join
  that waits for a trainer); ON_LOOP on the actor's own thread (quick calls that must stay on
  it, such as the profiler's).
- `waits_on_outside`: it waits on something outside the engine (a trainer's broadcast): a
  worker that shuts down does not wait for it.

Adding an op: its class here, where it is applied (scheduler/ or worker/control.py), the
engine's call (frontend/control.py), its route (api/routes/control.py), and a test.
"""

from __future__ import annotations

from enum import Enum
from typing import ClassVar

from runtime.tracing import ProfileRequest
from runtime.wire.codec import message, register

register(48)(ProfileRequest)


class Scope(Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"  # tensor-parallel rank 0
    EVERY_RANK = "every tensor-parallel rank"


class FanOut(Enum):
    ALL = "every data-parallel group"
    ONE_GROUP = "data-parallel group 0"


class Runs(Enum):
    BETWEEN_STEPS = "between steps"
    BESIDE_STEPS = "beside steps"
    ON_LOOP = "on the actor's loop"


class ControlOp:
    """The base of every control op: a `@message` dataclass, sent inside a `Control`."""

    __slots__ = ()
    scope: ClassVar[Scope] = Scope.SCHEDULER
    fan_out: ClassVar[FanOut] = FanOut.ALL
    runs: ClassVar[Runs] = Runs.BETWEEN_STEPS
    changes_weights: ClassVar[bool] = False
    drops_prefix_cache: ClassVar[bool] = False
    waits_on_outside: ClassVar[bool] = False

    def for_group(self, group: int) -> ControlOp:
        """This op as data-parallel group `group` applies it."""
        return self


@message(52)
class Control:
    """Frontend → scheduler (→ worker): a control op, answered by one `ControlDone`."""

    nonce: int
    op: ControlOp


@message(32)
class ControlDone:
    """The answer to a `Control`: `error` is empty if the op succeeded; `values` are what it
    read (`GetWeights`), else empty."""

    nonce: int
    error: str
    values: tuple[float, ...] = ()


# -- the scheduler's ---------------------------------------------------------------------


@message(30)
class Pause(ControlOp):
    """Hold new requests back; "keep" also stops computing (KV kept), "wait" lets the admitted
    ones finish. Answered once that holds: nothing in flight, and for "wait" nothing admitted
    left."""

    mode: str


@message(31)
class Resume(ControlOp):
    """Go on; held requests start in arrival order."""


@message(33)
class FlushCache(ControlOp):
    """Drop the prefix cache; refused while any request is open, unless `allow_open` (after a
    weight update)."""

    drops_prefix_cache = True
    allow_open: bool


@message(43)
class Configure(ControlOp):
    """Change the settings that may change live (`set_internal_state`)."""

    max_num_seqs: int


# -- the worker's ------------------------------------------------------------------------


class WeightChange(ControlOp):
    """An op that changes the served weights, on every rank, or on none: the KV cached from
    the old weights is stale."""

    __slots__ = ()
    scope = Scope.EVERY_RANK
    changes_weights = True
    drops_prefix_cache = True


@message(34)
class UpdateWeights(WeightChange):
    """Load the checkpoint at `model_path` into fresh tensors, check it against the served
    model, and swap. Steps planned after it use the new weights."""

    model_path: str


@message(42)
class UpdateWeightsFromFile(WeightChange):
    """Install the tensors of a safetensors file (some or all of the model's, by name), each
    checked before any is copied."""

    path: str


@message(35)
class GetWeights(ControlOp):
    """The first `truncate_size` values of a parameter (its checkpoint name or ours),
    flattened, in `ControlDone.values`."""

    scope = Scope.EVERY_RANK
    fan_out = FanOut.ONE_GROUP
    name: str
    truncate_size: int


@message(37)
class ReleaseMemory(ControlOp):
    """Free the KV pool and/or the weights (`tags` among "kv_cache", "weights"). The scheduler
    refuses while any request runs or waits, and drops its prefix cache with the KV."""

    scope = Scope.EVERY_RANK
    drops_prefix_cache = True
    tags: tuple[str, ...]


@message(38)
class ResumeMemory(WeightChange):
    """Bring back what `ReleaseMemory` freed (the weights from where they last came)."""

    tags: tuple[str, ...]


@message(39)
class JoinWeightGroup(ControlOp):
    """Join a trainer's torch.distributed world (the trainer is rank 0) as `rank_offset`
    (group g's worker as `rank_offset + g`); answered once joined, while steps go on."""

    scope = Scope.WORKER
    runs = Runs.BESIDE_STEPS
    waits_on_outside = True
    group_name: str
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    backend: str

    def for_group(self, group: int) -> JoinWeightGroup:
        return JoinWeightGroup(
            self.group_name,
            self.master_address,
            self.master_port,
            self.rank_offset + group,
            self.world_size,
            self.backend,
        )


@message(40)
class UpdateWeightsFromGroup(WeightChange):
    """Receive one broadcast from rank 0 of the group per named tensor, in order, check them
    all against the served model, then install them (rank 0 only: see worker/control.py)."""

    scope = Scope.WORKER
    waits_on_outside = True
    group_name: str
    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]


@message(41)
class LeaveWeightGroup(ControlOp):
    """Leave a group joined by `JoinWeightGroup`."""

    scope = Scope.WORKER
    group_name: str


@message(46)
class StartProfile(ControlOp):
    """Trace each actor's steps (runtime/tracing.py); the worker answers once recording."""

    scope = Scope.WORKER  # between steps: on the worker's torch thread, the one recorded
    request: ProfileRequest


@message(47)
class StopProfile(ControlOp):
    """Stop tracing; answered once every trace is written."""

    scope = Scope.WORKER  # between steps: on the worker's torch thread, the one recorded
