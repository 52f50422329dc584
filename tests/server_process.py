"""`runtime serve` as a real subprocess on a free port, for end-to-end tests."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

_READY = re.compile(r"serving \S+ at (http://\S+)")


class ServerProcess:
    """`model=None` serves the default model under its own name; any other is named "tiny"."""

    def __init__(self, model: Path | None, *args: str) -> None:
        named = [] if model is None else ["--model", str(model), "--served-model-name", "tiny"]
        command = [sys.executable, "-m", "runtime.cli.main", "serve", *named, "--port", "0", *args]
        env = os.environ | {"PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        self._ready = threading.Event()
        self.url = ""
        threading.Thread(target=self._read_log, daemon=True).start()
        if not self._ready.wait(timeout=120) or not self.url:
            self.process.kill()
            raise RuntimeError("the server did not start:\n" + "".join(self.lines))

    def _read_log(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:  # drained until exit, so the server never blocks
            self.lines.append(line)
            match = _READY.search(line)
            if match and not self.url:
                self.url = match.group(1)
                self._ready.set()
        self._ready.set()

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def child_pids(self) -> list[int]:
        out = subprocess.run(
            ["pgrep", "-P", str(self.process.pid)], capture_output=True, text=True, check=False
        )
        return [int(pid) for pid in out.stdout.split()]

    def terminate(self, timeout: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().lower()
    except FileNotFoundError:
        return "zombie"


def wait_until(predicate: object, timeout: float = 20.0, interval: float = 0.05) -> bool:
    """Poll a condition on another process (there is no event to wait on across processes)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(interval)
    return False


def metric(server: ServerProcess, name: str) -> float:
    """One figure of the server's /metrics, added up over its samples (e.g. dp ranks)."""
    text = httpx.get(server.url + "/metrics").text
    samples = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    assert samples, f"{name} not in /metrics"
    return sum(map(float, samples))
