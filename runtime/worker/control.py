"""Control ops in the worker: one path for one tensor-parallel rank and for N.

Rank 0 (the worker actor) broadcasts each EVERY_RANK op to the other ranks as it broadcasts
steps; then every rank runs `WorkerControl.apply`, and rank 0 answers. A change that can fail
on one rank (new weights that do not load, a file that does not fit, memory that does not come
back) is done in two phases: each rank prepares it, all take part in a roll call (`agree`),
and only if no rank failed does every rank commit it. So the ranks never serve different
weights: a failed update leaves every rank on the old ones, and the answer names the rank that
failed. With one rank the roll call is that rank's own answer.

WORKER ops run on rank 0 alone: a trainer's weight group (not with tensor parallelism yet:
each rank would have to slice its share out of every broadcast) and the profiler.

Errors and weight values travel through the store the ranks met in (small strings, bounded
slices), never pickle.
"""

from __future__ import annotations

import math

import torch

from runtime.wire.codec import WireError
from runtime.wire.control import (
    ControlOp,
    GetWeights,
    JoinWeightGroup,
    LeaveWeightGroup,
    ReleaseMemory,
    ResumeMemory,
    StartProfile,
    StopProfile,
    UpdateWeights,
    UpdateWeightsFromFile,
    UpdateWeightsFromGroup,
)
from runtime.worker import weight_group
from runtime.worker.model_runner import ModelRunner
from runtime.worker.profiler import WorkerProfiler
from runtime.worker.tp_group import agree, gather_shares

NOT_WITH_TP = "weight update groups are not available with --tensor-parallel-size > 1 yet"

Answer = tuple[str, tuple[float, ...]]  # (error or "", values read)


class WorkerControl:
    """The control ops of one rank (`profiler`: rank 0's)."""

    def __init__(self, runner: ModelRunner, profiler: WorkerProfiler | None = None) -> None:
        self.runner = runner
        self.weights = runner.weights
        self.tp = runner.tp
        self.groups = weight_group.WeightGroups(runner.device)
        self.profiler = profiler

    def apply(self, op: ControlOp) -> Answer:
        """Run `op` on this rank, in step with the others: what rank 0 answers."""
        match op:
            case UpdateWeights(model_path=path):
                model, error = self.weights.candidate(path)
                error = agree(self.tp, error)
                if not error:
                    assert model is not None
                    self.weights.serve(model, path)
                return error, ()
            case UpdateWeightsFromFile(path=path):
                return self._install_file(path), ()
            case ReleaseMemory(tags=tags):
                self.runner.release_memory(tags)
                return agree(self.tp, ""), ()
            case ResumeMemory(tags=tags):
                error = agree(self.tp, self.runner.resume_memory(tags))
                if error:  # back to released on every rank, as the engine still believes
                    self.runner.release_memory(tags)
                return error, ()
            case GetWeights(name=name, truncate_size=count):
                return self._weight_values(name, count)
            case JoinWeightGroup() if self.tp.size > 1:
                return NOT_WITH_TP, ()
            case JoinWeightGroup():
                return self._join(op), ()
            case UpdateWeightsFromGroup():
                return (NOT_WITH_TP if self.tp.size > 1 else self._update_from_group(op)), ()
            case LeaveWeightGroup(group_name=name):
                return self.groups.leave(name), ()
            case StartProfile(request=request):
                assert self.profiler is not None, "rank 0 profiles"
                return self.profiler.start(request), ()
            case StopProfile():
                assert self.profiler is not None, "rank 0 profiles"
                return self.profiler.stop(), ()
        raise WireError(f"the worker cannot apply a {type(op).__name__}")

    def _install_file(self, path: str) -> str:
        tensors, error = self.weights.read_file(path)  # every rank reads the same file
        if not error:
            error = self.weights.check_values(tensors)
        error = agree(self.tp, error)
        if error:
            return error
        error = self.weights.install(tensors)  # checked on every rank: this cannot fail
        if error:
            raise RuntimeError(f"rank {self.tp.rank} failed an update every rank checked: {error}")
        return ""

    def _update_from_group(self, op: UpdateWeightsFromGroup) -> str:
        name = op.group_name
        if not self.groups.joined(name):
            return f"no weight update group named {name!r} (init it first)"
        try:
            specs = weight_group.parse_specs(op.names, op.dtypes, op.shapes)
        except weight_group.WeightGroupError as exc:
            return self.groups.drop(name, str(exc))
        error = self.weights.check(specs)
        if error:  # nothing received: the trainer's broadcasts have no receiver
            return self.groups.drop(name, error)
        tensors, error = self.groups.receive(name, specs)
        return error or self.weights.install(tensors)

    def _weight_values(self, name: str, count: int) -> Answer:
        """The first `count` values of the whole parameter, flattened: each rank sends rank 0
        the part of its share that those values need, and rank 0 assembles them."""
        try:
            slot = self.weights.slot(name)
        except KeyError as exc:
            error = str(exc.args[0])
        else:
            error = ""
        failed = agree(self.tp, error)
        if failed:  # the same name is missing on every rank: rank 0's own words say it
            return error or failed, ()
        row = math.prod(slot.full_shape[1:])
        rows = min(math.ceil(count / row), slot.full_shape[0])  # whole rows that hold them
        # split by columns: this rank's columns of the first `rows` rows; split by rows (or
        # whole): this rank's rows among the first `rows`
        share = slot.dest[:rows] if slot.dim else slot.dest[: max(0, rows - slot.start)]
        values = slot.floats(share.detach().cpu())  # blocks: the values they stand for
        shares = gather_shares(self.tp, values.contiguous(), slot.start)
        if shares is None:  # not rank 0
            return "", ()
        whole = torch.zeros((rows, *slot.full_shape[1:]))
        for part, start in shares:
            if part.numel():  # else none of that rank's rows is among the first
                whole.narrow(slot.dim, start, part.shape[slot.dim]).copy_(part)
        return "", tuple(whole.flatten()[:count].tolist())

    def _join(self, op: JoinWeightGroup) -> str:
        return self.groups.join(
            op.group_name,
            op.master_address,
            op.master_port,
            op.rank_offset,
            op.world_size,
            op.backend,
        )

    def close(self) -> None:
        self.groups.leave_all()
