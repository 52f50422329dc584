"""Weights from a trainer process over torch.distributed, without files.

SGLang's `init_weights_update_group`, `update_weights_from_distributed` and
`destroy_weights_update_group`. The trainer is rank 0 of a world it starts with plain torch,
and broadcasts each tensor in turn:

    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://{address}:{port}", world_size=2, rank=0)
    for tensor in tensors:
        torch.distributed.broadcast(tensor, src=0)

The worker joins that world as rank `rank_offset` without making it its own default group
(tensor parallelism will need that one), so it builds the group the way `init_process_group`
builds a default one: torch's TCP store, under the key prefixes "default_pg", then the
group's name ("0"), then the device. These are torch internals: `tests/test_weight_group.py`
holds them to the torch we pin, with a real trainer process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import timedelta

import torch
from torch import distributed as dist

# How long joining (connecting to the trainer's store, the rendezvous) may take before the join
# fails and frees its name; how long an update's broadcasts may take together, and each one:
# past them the trainer is late, gone, or sent less, and the old weights serve on.
JOIN_TIMEOUT = timedelta(seconds=120)
CONNECT_TRY = timedelta(seconds=2)  # a cancelled join stops waiting within this
GROUP_TIMEOUT = timedelta(seconds=300)
TENSOR_TIMEOUT = timedelta(seconds=60)
BACKENDS = ("gloo", "nccl")
CANARY = 8  # bytes that tell a longer or shorter broadcast than announced (receive_checked)

# The dtypes a trainer may name, as SGLang's clients spell them ("bfloat16", "torch.float32").
DTYPES = {
    name: dtype
    for name, dtype in vars(torch).items()
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point
}
MAX_ITEMSIZE = max(dtype.itemsize for dtype in DTYPES.values())


class WeightGroupError(ValueError):
    """A group cannot be joined or used: the message says why."""


@dataclass(slots=True)
class WeightGroup:
    backend: dist.ProcessGroup | object  # a c10d backend (ProcessGroupGloo, ProcessGroupNCCL)
    rank: int
    world_size: int
    device: torch.device


def parse_dtype(name: str) -> torch.dtype:
    dtype = DTYPES.get(name.removeprefix("torch."))
    if dtype is None:
        raise WeightGroupError(f"dtype {name!r} is not a floating point torch dtype")
    return dtype


def parse_specs(
    names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]
) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """What update_weights_from_distributed announces, one (name, dtype, shape) per tensor."""
    if not len(names) == len(dtypes) == len(shapes):
        raise WeightGroupError(
            f"names, dtypes and shapes differ in length: {len(names)}, {len(dtypes)}, {len(shapes)}"
        )
    return [
        (name, parse_dtype(dtype), tuple(shape))
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True)
    ]


def join(
    address: str,
    port: int,
    rank: int,
    world_size: int,
    backend: str,
    device: torch.device,
    cancelled: threading.Event | None = None,
) -> WeightGroup:
    """Join the trainer's world as `rank`; blocks until every rank has (or JOIN_TIMEOUT, or
    until `cancelled` is set). `backend` "" is nccl on CUDA, gloo elsewhere."""
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    if backend not in BACKENDS:
        raise WeightGroupError(f"backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    if backend == "nccl" and device.type != "cuda":
        raise WeightGroupError("backend nccl needs --device cuda; use gloo on CPU")
    if not 0 < rank < world_size:
        raise WeightGroupError(
            f"rank_offset must be in [1, world_size): the trainer is rank 0; got rank "
            f"{rank} of {world_size}"
        )
    try:
        store = connect(address, port, world_size, cancelled or threading.Event())
        store = dist.PrefixStore("default_pg", store)  # as init_process_group names its world
        store = dist.PrefixStore("0/", store)  # the default group's name
        if backend == "gloo":
            store = dist.PrefixStore("cpu/", store)
            group: object = dist.ProcessGroupGloo(store, rank, world_size, GROUP_TIMEOUT)
        else:
            store = dist.PrefixStore("cuda/", store)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = GROUP_TIMEOUT
            group = dist.ProcessGroupNCCL(store, rank, world_size, options)
    except (RuntimeError, ValueError) as exc:  # refused, timed out, unresolvable address
        raise WeightGroupError(f"could not join {address}:{port} as rank {rank}: {exc}") from None
    return WeightGroup(group, rank, world_size, device)


def connect(address: str, port: int, world_size: int, cancelled: threading.Event) -> dist.Store:
    """A client of the trainer's store. Connecting blocks inside torch, where nothing can
    interrupt it, so it is tried for CONNECT_TRY at a time until JOIN_TIMEOUT: a join that
    was cancelled meanwhile gives up after the try under way."""
    deadline = time.monotonic() + JOIN_TIMEOUT.total_seconds()
    while True:
        left = deadline - time.monotonic()
        try_for = timedelta(seconds=max(min(left, CONNECT_TRY.total_seconds()), 0.001))
        try:
            store = dist.TCPStore(address, port, world_size, False, timeout=try_for)
        except RuntimeError:
            if cancelled.is_set() or left <= CONNECT_TRY.total_seconds():
                raise
            continue
        store.set_timeout(JOIN_TIMEOUT)  # the rendezvous waits on it for the other ranks
        return store


def receive(
    group: WeightGroup, specs: list[tuple[str, torch.dtype, tuple[int, ...]]]
) -> list[tuple[str, torch.Tensor]]:
    """One broadcast from rank 0 per named tensor, in order, each into a fresh tensor; each
    within TENSOR_TIMEOUT, all within GROUP_TIMEOUT (generation is paused meanwhile)."""
    deadline = time.monotonic() + GROUP_TIMEOUT.total_seconds()
    received = []
    for name, dtype, shape in specs:
        tensor = torch.empty(shape, dtype=dtype, device=group.device)
        left = min(deadline - time.monotonic(), TENSOR_TIMEOUT.total_seconds())
        try:
            if group.device.type == "cpu":
                receive_checked(group, tensor, timedelta(seconds=max(left, 0.001)))
            else:
                broadcast(group, tensor, timedelta(seconds=max(left, 0.001)))
        except RuntimeError as exc:  # the trainer left, or sent less than announced in time
            raise WeightGroupError(f"receiving {name!r} failed: {exc}") from None
        received.append((name, tensor))
    return received


def broadcast(group: WeightGroup, tensor: torch.Tensor, timeout: timedelta) -> None:
    """Receive rank 0's broadcast into `tensor`, which must be exactly its size."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    work = group.backend.broadcast([tensor], options)  # type: ignore[attr-defined]
    work.wait(timeout)


def receive_checked(group: WeightGroup, tensor: torch.Tensor, timeout: timedelta) -> None:
    """`broadcast` into `tensor` when the trainer may send another size than it announced
    (another dtype): gloo aborts the whole process when more bytes come than the receiving
    buffer holds, so they are received into bytes with room for MAX_ITEMSIZE an element, with
    random canary bytes either side of where the announced size ends. A longer message
    overwrites the canary after the end, a shorter one leaves the one before it."""
    size = tensor.numel() * tensor.element_size()
    buffer = torch.empty(tensor.numel() * MAX_ITEMSIZE + CANARY, dtype=torch.uint8)
    start = max(size - CANARY, 0)
    canary = torch.randint(0, 256, (size + CANARY - start,), dtype=torch.uint8)
    buffer[start : size + CANARY] = canary
    broadcast(group, buffer, timeout)
    if not torch.equal(buffer[size : size + CANARY], canary[size - start :]):
        raise RuntimeError(f"the trainer sent more than the announced {size} bytes")
    if size and torch.equal(buffer[start:size], canary[: size - start]):
        raise RuntimeError(f"the trainer sent less than the announced {size} bytes")
    tensor.reshape(-1).view(torch.uint8).copy_(buffer[:size])


def leave(group: WeightGroup) -> None:
    shutdown = getattr(group.backend, "shutdown", None)
    if shutdown is not None:
        with suppress(RuntimeError):  # already broken: nothing left to close
            shutdown()


@dataclass(eq=False)
class Joining:
    """A join waiting for its trainer (its identity tells it from a later join of the name)."""

    cancelled: threading.Event = field(default_factory=threading.Event)


class WeightGroups:
    """The trainers' groups a worker has joined, by name. Joins run in threads of their own
    while steps go on, so the names are reserved under a lock: a second join of a name that
    is still joining is refused, as is a use of it before it has joined."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._groups: dict[str, WeightGroup | Joining] = {}
        self._lock = threading.Lock()

    def join(
        self, name: str, address: str, port: int, rank: int, world_size: int, backend: str
    ) -> str:
        """Join (blocking until the trainer comes, or JOIN_TIMEOUT); "" or what went wrong.
        `leave` cancels a join still waiting: its name is free at once."""
        joining = Joining()
        with self._lock:
            if name in self._groups:
                return f"a weight update group named {name!r} exists already"
            self._groups[name] = joining
        try:
            group = join(address, port, rank, world_size, backend, self.device, joining.cancelled)
        except WeightGroupError as exc:
            self._forget(name, joining)
            return str(exc)
        with self._lock:
            if self._groups.get(name) is joining:
                self._groups[name] = group
                return ""
        leave(group)  # cancelled while it waited for the trainer
        return f"the join of {name!r} was cancelled (destroy_weights_update_group)"

    def _forget(self, name: str, joining: Joining) -> None:
        with self._lock:
            if self._groups.get(name) is joining:
                del self._groups[name]

    def joined(self, name: str) -> bool:
        return isinstance(self._groups.get(name), WeightGroup)

    def receive(
        self, name: str, specs: list[tuple[str, torch.dtype, tuple[int, ...]]]
    ) -> tuple[list[tuple[str, torch.Tensor]], str]:
        """The tensors the trainer broadcasts on joined group `name`, or what went wrong (and
        then the group is left: it is out of step with the trainer)."""
        group = self._groups[name]
        assert isinstance(group, WeightGroup), "joined first"
        try:
            return receive(group, specs), ""
        except WeightGroupError as exc:
            return [], self.drop(name, str(exc))

    def drop(self, name: str, error: str) -> str:
        """A failed update leaves the group out of step with the trainer: leave it."""
        self.leave(name)
        return f"{error} (the weight update group {name!r} was left: init it again)"

    def leave(self, name: str) -> str:
        """Leave a joined group, or cancel a join still waiting for its trainer."""
        with self._lock:
            group = self._groups.pop(name, None)
        if group is None:
            return f"no weight update group named {name!r}"
        if isinstance(group, WeightGroup):
            leave(group)
        else:
            group.cancelled.set()
        return ""

    def leave_all(self) -> None:
        with self._lock:
            groups = [g for g in self._groups.values() if isinstance(g, WeightGroup)]
            for joining in self._groups.values():
                if isinstance(joining, Joining):
                    joining.cancelled.set()
            self._groups = {}
        for group in groups:
            leave(group)
