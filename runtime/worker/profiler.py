"""The worker's side of `start_profile`: `torch.profiler` around its steps, exported as a
Chrome trace (runtime/tracing.py names the files)."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from runtime.tracing import ProfileRequest, trace_path


class WorkerProfiler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._profile: profile | None = None
        self._request: ProfileRequest | None = None
        self._steps = 0

    def start(self, request: ProfileRequest) -> str:
        """Start recording; "" or why not."""
        if self._profile is not None:
            return "the worker is already profiling"
        activities = [ProfilerActivity.CPU]
        if "GPU" in request.activities and self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)  # on CPU there is no GPU work to trace
        self._profile = profile(
            activities=activities,
            record_shapes=request.record_shapes,
            with_stack=request.with_stack,
        )
        self._profile.start()
        self._request, self._steps = request, 0
        return ""

    def step_done(self) -> None:
        """Count a step; with `num_steps`, stop after that many."""
        if self._request is None:
            return
        self._steps += 1
        if self._request.num_steps and self._steps >= self._request.num_steps:
            self.stop()

    def stop(self) -> str:
        """Stop recording and write the trace; "" or why it could not be written. Stopping
        when not recording (`num_steps` ran out) is fine."""
        if self._profile is None or self._request is None:
            return ""
        prof, request = self._profile, self._request
        self._profile = self._request = None
        prof.stop()
        path = trace_path(request.output_dir, "worker")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(path))
        except OSError as exc:
            return f"could not write {path}: {exc}"
        return ""

    @property
    def running(self) -> bool:
        return self._profile is not None
