"""The worker's side of `start_profile`: `torch.profiler` around its steps, exported as a
Chrome trace (runtime/tracing.py names the files)."""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from runtime.tracing import ProfileRequest, trace_path, write_new

# torch.profiler records the ops of the thread that starts it, so a worker starts and stops it
# on its torch thread (runtime/worker/torch_thread.py), where its steps run. It is one per
# process: two at once crash it. Workers that share a process (data parallelism in inproc
# mode) therefore take turns: the first to start records, the others record nothing. Their
# torch threads start and stop at once, hence the lock.
_recording = False
_turns = threading.Lock()


class WorkerProfiler:
    def __init__(self, device: torch.device, name: str = "worker") -> None:
        self.device = device
        self.name = name  # of the trace file
        self._profile: profile | None = None
        self._request: ProfileRequest | None = None
        self._steps = 0

    def start(self, request: ProfileRequest) -> str:
        """Start recording; "" or why not."""
        global _recording
        if self._profile is not None or self._request is not None:
            return "the worker is already profiling"
        self._request, self._steps = request, 0
        activities = [ProfilerActivity.CPU]
        if "GPU" in request.activities and self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)  # on CPU there is no GPU work to trace
        with _turns:
            if _recording:
                return ""  # another worker of this process records
            self._profile = profile(
                activities=activities,
                record_shapes=request.record_shapes,
                with_stack=request.with_stack,
            )
            self._profile.start()
            _recording = True
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
        global _recording
        prof, request = self._profile, self._request
        self._profile = self._request = None
        if prof is None or request is None:
            return ""
        with _turns:
            prof.stop()
            _recording = False
        path = trace_path(request.output_dir, self.name)
        try:  # torch writes where it is told: into a folder of ours, then copied out new
            with tempfile.TemporaryDirectory() as private:
                exported = Path(private) / "trace.json"
                prof.export_chrome_trace(str(exported))
                write_new(path, exported.read_bytes())
        except OSError as exc:
            return f"could not write {path}: {exc}"
        return ""

    @property
    def running(self) -> bool:
        return self._profile is not None

    @property
    def counting(self) -> bool:
        """Whether steps count toward a profile's `num_steps`."""
        return self._request is not None
