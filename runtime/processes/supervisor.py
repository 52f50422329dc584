"""Start the scheduler and worker actors, as child processes or as tasks, under one nursery.

Either way the actors run the same code; only their addresses differ (`ipc://` or `inproc://`).
Supervision is trio's one-cancels-all: an actor process that dies, even with exit code 0, raises
`ActorDiedError` into the engine's nursery, which cancels everything else. Before raising, it
awaits `on_death(error)`, which lets the frontend end its requests with that error first.

Children never outlive us. Each reads its stdin, a pipe from us, and exits on EOF, which the
kernel delivers however we die, SIGKILL included (STACK.md §5: PR_SET_PDEATHSIG fires when trio's
spawning *thread* exits, so it cannot be used). Cancellation closes that pipe, then SIGKILLs a
child still there after STOP_GRACE seconds; children ignore SIGTERM (see actor_main).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import trio

from runtime.config.engine import EngineConfig
from runtime.processes import ipc_dir
from runtime.tracing import actor_name
from runtime.wire.transport import Channel, inproc_address, ipc_address

if TYPE_CHECKING:  # never at run time: a process-mode parent must not load torch
    from torch import distributed as dist


class ActorDiedError(RuntimeError):
    """A scheduler or worker process exited while the engine was running."""


OnDeath = Callable[[ActorDiedError], Awaitable[None]]

STOP_GRACE = 5.0


@dataclass(frozen=True, slots=True)
class Group:
    """What one data-parallel group's actors start with."""

    config: EngineConfig
    eos_token_ids: frozenset[int]
    progress: bool
    on_death: OnDeath
    dp_rank: int


async def start_actors(
    nursery: trio.Nursery,
    config: EngineConfig,
    eos_token_ids: frozenset[int],
    progress: bool,
    on_death: OnDeath,
) -> tuple[list[Channel], dict[str, trio.Process]]:
    """Start a scheduler and a worker per data-parallel group; return the frontend's channel
    to each group's scheduler (not yet ready) and the child processes by name (none in
    inproc mode): "scheduler" and "worker", or "scheduler-dp0", "worker-dp0"... ."""
    channels: list[Channel] = []
    processes: dict[str, trio.Process] = {}
    start = _start_tasks if config.mode == "inproc" else _start_processes
    for dp_rank in range(config.data_parallel_size):
        group = Group(config, eos_token_ids, progress, on_death, dp_rank)
        address, spawned = await start(nursery, group)
        processes |= spawned
        channels.append(Channel.dial(address))
    return channels, processes


async def _start_tasks(nursery: trio.Nursery, group: Group) -> tuple[str, dict[str, trio.Process]]:
    config, dp_rank = group.config, group.dp_rank
    # imported here: a process-mode parent only spawns the actors, never imports them
    from runtime.scheduler.actor import SchedulerActor
    from runtime.worker.actor import WorkerActor

    frontend_address, worker_address = inproc_address("frontend"), inproc_address("worker")
    scheduler = SchedulerActor(config, group.eos_token_ids, dp_rank)
    await nursery.start(scheduler.serve, frontend_address, worker_address)  # can be dialed
    store = (
        _start_rank_threads(nursery, config, group.on_death, dp_rank)
        if config.tensor_parallel_size > 1
        else None
    )
    worker = WorkerActor(config, group.progress, dp_rank, store)
    nursery.start_soon(_reporting, worker.name, group.on_death, worker.serve, worker_address)
    return frontend_address, {}  # no processes: the actors are tasks


async def _reporting(name: str, on_death: OnDeath, run: Callable[..., Awaitable[object]],
                     *args: object) -> None:  # fmt: skip
    """Run an actor task; if it fails, report it as a dead actor (its requests end with the
    error, as when a process dies) before the failure cancels the engine."""
    try:
        await run(*args)
    except Exception as exc:
        cause: BaseException = exc
        while isinstance(cause, BaseExceptionGroup) and len(cause.exceptions) == 1:
            cause = cause.exceptions[0]  # what the actor's own nurseries wrapped
        error = ActorDiedError(f"the {name} actor failed: {type(cause).__name__}: {cause}")
        await on_death(error)
        raise error from exc


def _start_rank_threads(
    nursery: trio.Nursery, config: EngineConfig, on_death: OnDeath, dp_rank: int
) -> dist.Store:
    """Tensor-parallel ranks 1.. as threads, meeting rank 0 in a fresh in-memory store; a
    rank's exception comes back through its thread and stops the engine."""
    from torch import distributed as dist

    from runtime.worker.shard_follower import follow

    store = dist.HashStore()
    for tp_rank in range(1, config.tensor_parallel_size):
        # abandoned on cancel: a rank waiting for the next step must not stall shutdown
        in_thread = partial(trio.to_thread.run_sync, abandon_on_cancel=True)
        name = f"{actor_name('worker', dp_rank, config.data_parallel_size)}-tp{tp_rank}"
        nursery.start_soon(_reporting, name, on_death, in_thread, follow, config, tp_rank, store)
    return store


async def _start_processes(
    nursery: trio.Nursery, group: Group
) -> tuple[str, dict[str, trio.Process]]:
    config, dp_rank, on_death = group.config, group.dp_rank, group.on_death
    directory = ipc_dir.make()
    nursery.start_soon(_remove_on_exit, directory)
    frontend_address = ipc_address(directory, "frontend")
    worker_address = ipc_address(directory, "worker")
    store = f"{directory}/tp.store"  # a FileStore: tensor-parallel ranks meet there
    spec: dict[str, object] = {
        "config": config.to_dict(),
        "eos_token_ids": sorted(group.eos_token_ids),
        "ipc_dir": directory,  # removed by the children too, should we be SIGKILLed
        "dp_rank": dp_rank,
        "log_level": logging.getLogger().getEffectiveLevel(),  # children log as we do
    }
    scheduler, worker = (
        actor_name(role, dp_rank, config.data_parallel_size) for role in ("scheduler", "worker")
    )
    processes = {
        scheduler: await _spawn(
            nursery,
            "scheduler",
            scheduler,
            spec | {"listen": [frontend_address, worker_address]},
            on_death,
        ),
        worker: await _spawn(
            nursery,
            "worker",
            worker,
            spec | {"dial": worker_address, "progress": group.progress, "tp_store": store},
            on_death,
        ),
    }
    for tp_rank in range(1, config.tensor_parallel_size):  # they meet rank 0 in the store
        name = f"{worker}-tp{tp_rank}"
        shard_spec = spec | {"tp_rank": tp_rank, "tp_store": store}
        processes[name] = await _spawn(nursery, "shard", name, shard_spec, on_death)
    return frontend_address, processes


async def _spawn(
    nursery: trio.Nursery, role: str, name: str, spec: dict[str, object], on_death: OnDeath
) -> trio.Process:
    command = [sys.executable, "-m", "runtime.processes.actor_main", role, json.dumps(spec)]
    process: trio.Process = await nursery.start(_supervise, name, command, on_death)
    return process


async def _supervise(
    role: str,
    command: list[str],
    on_death: OnDeath,
    *,
    task_status: trio.TaskStatus[trio.Process],
) -> None:
    process = await trio.run_process(
        command,
        stdin=subprocess.PIPE,  # never written: its EOF tells the child we are gone
        check=False,
        start_new_session=True,  # a terminal's Ctrl-C reaches only us; we stop the children
        deliver_cancel=_stop,
        task_status=task_status,
    )
    error = ActorDiedError(f"the {role} process exited with code {process.returncode}")
    await on_death(error)
    raise error


async def _stop(process: trio.Process) -> None:
    """How cancellation stops a child (shielded by trio): EOF on its stdin, then SIGKILL."""
    if process.stdin is not None:
        await process.stdin.aclose()
    await trio.sleep(STOP_GRACE)  # cancelled by trio as soon as the child has exited
    process.kill()


async def _remove_on_exit(directory: str) -> None:
    try:
        await trio.sleep_forever()
    finally:
        ipc_dir.remove(directory)
