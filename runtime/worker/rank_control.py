"""Control messages on every tensor-parallel rank at once.

Rank 0 broadcasts the message (as it broadcasts steps); then every rank runs `apply`, which
returns what rank 0 answers. A change that can fail on one rank (new weights that do not
load, a file that does not fit, memory that does not come back) is done in two phases: each
rank prepares it, all take part in a roll call (`agree`), and only if no rank failed does
every rank commit it. So the ranks never serve different weights: a failed update leaves
every rank on the old ones, and the answer names the rank that failed.

Errors and weight values travel through the store the ranks met in (small strings, bounded
slices), never pickle.
"""

from __future__ import annotations

import json
import math

import torch

from runtime.wire.messages import (
    GetWeights,
    ReleaseMemory,
    ResumeMemory,
    UpdateWeights,
    UpdateWeightsFromFile,
)
from runtime.worker.loader import find_slot
from runtime.worker.model_runner import ModelRunner
from runtime.worker.tp_group import agree

RankControl = UpdateWeights | UpdateWeightsFromFile | ReleaseMemory | ResumeMemory | GetWeights


def apply(runner: ModelRunner, msg: RankControl) -> tuple[str, tuple[float, ...]]:
    """Run `msg` on this rank, in step with the others: (error or "", weight values)."""
    tp = runner.tp
    match msg:
        case UpdateWeights(model_path=path):
            model, error = runner.candidate(path)
            error = agree(tp, error)
            if not error:
                runner.model, runner.model_path = model, path
            return error, ()
        case UpdateWeightsFromFile(path=path):
            return _install_file(runner, path), ()
        case ReleaseMemory(tags=tags):
            runner.release_memory(tags)
            return agree(tp, ""), ()
        case ResumeMemory(tags=tags):
            error = agree(tp, runner.resume_memory(tags))
            if error:  # back to released on every rank, as the engine still believes
                runner.release_memory(tags)
            return error, ()
        case GetWeights(name=name, truncate_size=count):
            return _weight_values(runner, name, count)


def _install_file(runner: ModelRunner, path: str) -> str:
    tensors, error = runner.read_file(path)  # every rank reads the same file
    if not error:
        error = runner.check_tensors([(name, t.dtype, tuple(t.shape)) for name, t in tensors])
    error = agree(runner.tp, error)
    if error:
        return error
    error = runner.install_tensors(tensors)  # checked on every rank: this cannot fail
    if error:
        raise RuntimeError(f"rank {runner.tp.rank} failed an update every rank checked: {error}")
    return ""


def _weight_values(runner: ModelRunner, name: str, count: int) -> tuple[str, tuple[float, ...]]:
    """The first `count` values of the whole parameter, flattened: each rank leaves in the
    store the part of its share that those values need, and rank 0 assembles them."""
    tp = runner.tp
    try:
        if runner.model is None:
            raise KeyError("the weights are released (resume_memory_occupation first)")
        slot = find_slot(runner.model, name)
    except KeyError as exc:
        error = str(exc.args[0])
    else:
        error = ""
    error = agree(tp, error)
    if error:
        return error.split(": ", 1)[1], ()  # the same on every rank: no need to name one
    row = math.prod(slot.full_shape[1:])
    rows = min(math.ceil(count / row), slot.full_shape[0])  # whole rows that hold them
    # split by columns: this rank's columns of the first `rows` rows; split by rows (or
    # whole): this rank's rows among the first `rows`
    share = slot.dest[:rows] if slot.dim else slot.dest[: max(0, rows - slot.start)]
    key = f"weights-{tp.calls}"
    header = {"dim": slot.dim, "start": slot.start, "shape": list(share.shape)}
    data = share.detach().float().cpu().contiguous().numpy().tobytes()
    tp.store.set(f"{key}-{tp.rank}", json.dumps(header).encode() + b"\n" + data)
    agree(tp, "")  # every share is in the store
    if tp.rank != 0:
        return "", ()
    whole = torch.zeros((rows, *slot.full_shape[1:]))
    for rank in range(tp.size):
        raw = tp.store.get(f"{key}-{rank}")
        head, _, body = raw.partition(b"\n")
        part = json.loads(head)
        if not body:  # none of its rows is among the first
            continue
        values = torch.frombuffer(bytearray(body), dtype=torch.float32).view(part["shape"])
        whole.narrow(part["dim"], part["start"], values.shape[part["dim"]]).copy_(values)
    return "", tuple(whole.flatten()[:count].tolist())
