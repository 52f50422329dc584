"""The process group of one model replica's tensor-parallel ranks, and the messages rank 0
broadcasts through it.

The group is built by hand (`ProcessGroupGloo` / `ProcessGroupNCCL` over a store), never with
`init_process_group`: a trainer's weight-update group (weight_group.py) may live in the same
process, and ranks of one process (the inproc layout: one thread per rank) share nothing
global. The store is a `HashStore` shared by threads, or a `FileStore` in the engine's private
ipc directory for processes: no port to pick, nothing to race for. Gloo always talks over
loopback: tensor parallelism never spans machines.

Messages travel as msgpack bytes (the actors' codec, never pickle) in a uint8 tensor, after
their length: two broadcasts per step.
"""

from __future__ import annotations

import contextlib
import json
from datetime import timedelta

import torch
from torch import distributed as dist

from runtime.layers.parallel import TPGroup
from runtime.wire.codec import decode, encode

JOIN_TIMEOUT = timedelta(seconds=120)  # the other ranks are starting (importing torch...)
LOAD_TIMEOUT = timedelta(minutes=30)  # a rank loading its share of a checkpoint
IDLE = timedelta(days=3650)  # a follower waits for the next step as long as the server idles


def make_store(path: str | None, size: int) -> dist.Store:
    """A FileStore at `path` (ranks in processes), or a HashStore (ranks as threads)."""
    return dist.HashStore() if path is None else dist.FileStore(path, size)


def join(rank: int, size: int, store: dist.Store, device: torch.device) -> TPGroup:
    """This rank's handle on the group; returns once every rank has joined."""
    store = dist.PrefixStore("tp/", store)
    backend: object
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = JOIN_TIMEOUT
        backend = dist.ProcessGroupNCCL(store, rank, size, options)
    else:
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = JOIN_TIMEOUT
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        backend = dist.ProcessGroupGloo(store, rank, size, options)
    return TPGroup(rank, size, backend, str(device), store)


def leave(group: TPGroup) -> None:
    """Close the group: a peer blocked in a collective fails at once instead of waiting."""
    shutdown = getattr(group.backend, "shutdown", None)
    if shutdown is not None:
        with contextlib.suppress(RuntimeError):  # already broken: nothing left to close
            shutdown()


def rank_device(device: str, tp_rank: int) -> torch.device:
    """Rank r of a CUDA replica uses GPU r (of those CUDA_VISIBLE_DEVICES shows)."""
    parsed = torch.device(device)
    return torch.device("cuda", tp_rank) if parsed.type == "cuda" else parsed


def send_message(group: TPGroup, msg: object) -> None:
    """Rank 0: broadcast `msg` to the other ranks."""
    data = encode(msg)
    group.broadcast_(torch.tensor([len(data)], dtype=torch.int64, device=group.device))
    group.broadcast_(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(group.device))


def receive_message(group: TPGroup) -> object:
    """The other ranks: the next message rank 0 broadcasts, however long that takes."""
    length = torch.zeros(1, dtype=torch.int64, device=group.device)
    group.broadcast_(length, IDLE)
    data = torch.empty(int(length.item()), dtype=torch.uint8, device=group.device)
    group.broadcast_(data)
    return decode(data.cpu().numpy().tobytes())


def agree(group: TPGroup, error: str) -> str:
    """Roll call: "" if every rank's `error` is "", else the first failed rank's, named.
    Every rank must call it, in the same order (the store keys count the calls). It waits
    up to LOAD_TIMEOUT: the others may be loading their share of a large checkpoint. With one
    rank the roll call is that rank's own answer."""
    if group.size == 1:
        return error
    group.calls += 1
    key = f"control-{group.calls}"
    if error:
        group.store.set(f"{key}-{group.rank}", f"tensor-parallel rank {group.rank}: {error}")
    failed = torch.zeros(group.size, device=group.device)
    failed[group.rank] = bool(error)
    group.all_reduce_(failed, LOAD_TIMEOUT)
    if not failed.any():
        return ""
    first = int(failed.nonzero()[0])
    return str(group.store.get(f"{key}-{first}").decode())


def gather_shares(
    group: TPGroup, share: torch.Tensor, start: int
) -> list[tuple[torch.Tensor, int]] | None:
    """Every rank's CPU float32 `share` of a tensor, with where it `start`s, on rank 0 (None
    on the others); each rank must call it. Through the store: small slices, never pickle."""
    if group.size == 1:
        return [(share, start)]
    group.calls += 1
    key = f"shares-{group.calls}"
    header = {"start": start, "shape": list(share.shape)}
    group.store.set(
        f"{key}-{group.rank}", json.dumps(header).encode() + b"\n" + share.numpy().tobytes()
    )
    agree(group, "")  # every share is in the store
    if group.rank != 0:
        return None
    shares = []
    for rank in range(group.size):
        head, _, body = group.store.get(f"{key}-{rank}").partition(b"\n")
        part = json.loads(head)
        values = torch.frombuffer(bytearray(body), dtype=torch.float32) if body else torch.empty(0)
        shares.append((values.view(part["shape"]), part["start"]))
    return shares


def smallest(group: TPGroup, value: int) -> int:
    """The smallest of every rank's `value` (every rank must call it, like `agree`): e.g. KV
    blocks, which must be the same count on all ranks, as the scheduler plans for one."""
    if group.size == 1:
        return value
    values = torch.zeros(group.size, dtype=torch.int64, device=group.device)
    values[group.rank] = value
    group.all_reduce_(values, LOAD_TIMEOUT)
    return int(values.min())
