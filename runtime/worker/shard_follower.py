"""A tensor-parallel rank other than 0: its share of the model, and a loop that runs every
step rank 0 broadcasts. It has no socket and no trio loop: rank 0 (the worker actor) is its
only link to the engine, and the supervisor runs it as a thread (inproc) or a child process.

It dies loudly: a failure to start names the rank and the cause; a broken group (rank 0 gone)
ends it with `TPGroupError`; `StopShards` ends it cleanly.
"""

from __future__ import annotations

import torch
from torch import distributed as dist

from runtime.config.engine import EngineConfig
from runtime.layers.parallel import TPGroup
from runtime.wire.codec import WireError
from runtime.wire.control import ControlOp
from runtime.wire.messages import ShardStep, StopShards
from runtime.worker import tp_group
from runtime.worker.control import WorkerControl
from runtime.worker.model_runner import ModelRunner


class RankStartError(RuntimeError):
    """A tensor-parallel rank could not build its share of the model."""


def follow(config: EngineConfig, tp_rank: int, store: dist.Store | str) -> None:
    """Join the group as `tp_rank`, build this rank's share, then follow rank 0 until it
    stops."""
    runner = start_rank(config, tp_rank, store)
    group = runner.tp
    control = WorkerControl(runner)
    try:
        while True:
            msg = tp_group.receive_message(group)
            match msg:
                case ShardStep():
                    runner.follow(msg)
                case ControlOp():
                    control.apply(msg)  # rank 0 answers for every rank
                case StopShards():
                    return
                case _:
                    raise WireError(f"rank {tp_rank} got an unexpected {type(msg).__name__}")
    finally:
        tp_group.leave(group)


def start_rank(
    config: EngineConfig, tp_rank: int, store: dist.Store | str, progress: bool = False
) -> ModelRunner:
    """Join the group as `tp_rank` (in a FileStore at `store`, if a path) and build this
    rank's share; the group is left again if that fails."""
    if isinstance(store, str):
        store = tp_group.make_store(store, config.tensor_parallel_size)
    device = tp_group.rank_device(config.device, tp_rank)
    group = tp_group.join(tp_rank, config.tensor_parallel_size, store, device)
    try:
        return build_rank(config, group, device, progress)
    except BaseException:
        tp_group.leave(group)
        raise


def build_rank(
    config: EngineConfig, group: TPGroup, device: torch.device, progress: bool = False
) -> ModelRunner:
    """This rank's runner, once every rank has built its own: a rank that cannot start
    stops the engine at startup, not at its first step. Every rank takes part in the roll
    call, failed or not, so that every rank (rank 0 included, whose error is the one the
    engine reports) raises the first failed rank's cause."""
    error = ""
    try:
        runner = ModelRunner(config, progress, group, device)
    except Exception as exc:
        error = f"could not start on {device}: {type(exc).__name__}: {exc}"
    error = tp_group.agree(group, error)
    if error:
        raise RankStartError(error)
    # the scheduler plans one pool for all ranks: a rank with fewer blocks would be handed
    # ids past its end (equal shards size equal pools; unequal GPUs may not)
    fewest = tp_group.smallest(group, runner.num_blocks)
    most = -tp_group.smallest(group, -runner.num_blocks)
    if fewest != most:
        raise RankStartError(
            f"the ranks' KV pools differ ({fewest} to {most} blocks): set --kv-cache-memory"
        )
    return runner
