"""Profiling traces (`start_profile` / `stop_profile`), as Chrome trace JSON files that
chrome://tracing and Perfetto open: one file per actor, named `<actor>-rank<N>.trace.json`,
created new and private (a name that exists, or a link planted there, is an error: profile
into a new folder).

The worker records `torch.profiler`'s trace of its steps; the scheduler and the frontend record
where each step's time went on their side (`PhaseTrace`: schedule, wait, update; dispatch).
With `num_steps`, each actor stops by itself after that many steps of its own.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class ProfileRequest:
    output_dir: str
    num_steps: int  # 0: until stop_profile
    activities: tuple[str, ...]  # "CPU", "GPU"
    record_shapes: bool
    with_stack: bool


def actor_name(role: str, dp_rank: int, dp_size: int) -> str:
    """An actor's name in logs, process lists and trace files: "worker", or "worker-dp1"
    when there are several data-parallel groups."""
    return role if dp_size == 1 else f"{role}-dp{dp_rank}"


def trace_path(output_dir: str, actor: str, rank: int = 0) -> Path:
    return Path(output_dir) / f"{actor}-rank{rank}.trace.json"


class PhaseTrace:
    """Spans of an actor's own phases, kept while profiling, written as one Chrome trace."""

    def __init__(self, actor: str) -> None:
        self.actor = actor
        self.request: ProfileRequest | None = None
        self._events: list[dict[str, Any]] = []
        self._steps = 0

    @property
    def on(self) -> bool:
        return self.request is not None

    def start(self, request: ProfileRequest) -> None:
        self.request, self._events, self._steps = request, [], 0

    def span(self, name: str, started: float, ended: float, **args: Any) -> None:
        """A phase from `started` to `ended` (time.perf_counter() seconds)."""
        if self.request is not None:
            self._events.append(
                {"name": name, "ph": "X", "ts": started * 1e6, "dur": (ended - started) * 1e6,
                 "pid": self.actor, "tid": 0, "args": args}
            )  # fmt: skip

    def step_done(self) -> None:
        """Count a step; once `num_steps` are traced, write the trace and stop."""
        if self.request is None:
            return
        self._steps += 1
        if self.request.num_steps and self._steps >= self.request.num_steps:
            self.stop()

    def stop(self) -> str:
        """Stop, and write the trace if profiling; "" or why it could not be written (a trace
        is never worth stopping an actor for)."""
        if self.request is None:
            return ""
        path = trace_path(self.request.output_dir, self.actor)
        events, self.request, self._events = self._events, None, []
        try:
            write_trace(path, events)
        except OSError as exc:
            return f"could not write {path}: {exc}"
        return ""

    def discard(self) -> None:
        self.request, self._events = None, []


def write_trace(path: Path, events: list[dict[str, Any]]) -> None:
    write_new(path, json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}).encode())


def write_new(path: Path, data: bytes) -> None:
    """A new file only we may read, never written through a link or over another file."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    with os.fdopen(os.open(path, flags, 0o600), "wb") as file:
        file.write(data)


def now() -> float:
    return time.perf_counter()
