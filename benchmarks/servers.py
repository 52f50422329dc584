"""Start and stop OpenAI-compatible servers for benchmarks, and account their startup time,
CPU time and peak memory."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

_TICK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def process_tree(root: int) -> list[int]:
    """`root` and all its descendants."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


def peak_rss_mib(pid: int) -> float:
    """The most resident memory one process has held (VmHWM), in MiB (0 if it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def process_name(pid: int) -> str:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    words = [w.decode(errors="replace") for w in cmdline if w]
    for marker in ("scheduler", "worker"):
        if "runtime.processes.actor_main" in words and marker in words:
            return marker
    if any("runtime.cli.main" in w for w in words):
        return "api"
    comm = (
        Path(f"/proc/{pid}/comm").read_text().strip() if Path(f"/proc/{pid}/comm").exists() else ""
    )
    return comm or (Path(words[0]).name if words else "?")


class Server:
    """A server subprocess that serves `served` at `url` once `/v1/models` answers."""

    def __init__(
        self,
        name: str,
        command: list[str],
        port: int,
        env: dict[str, str] | None = None,
        startup_timeout: float = 600.0,
        cwd: str | None = None,
    ) -> None:
        self.name = name
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = Path(f"/tmp/bench-{name}-{port}.log")
        log = self.log_path.open("w")
        self.process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=os.environ | (env or {}),
            start_new_session=True,
            cwd=cwd,
        )
        self.startup_seconds = 0.0
        started = time.monotonic()
        deadline = started + startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{name} exited; see {self.log_path}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    self.startup_seconds = time.monotonic() - started  # launch to serving
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{name} did not start in {startup_timeout:.0f} s; see {self.log_path}")

    def cpu_by_process(self) -> dict[str, float]:
        usage: dict[str, float] = {}
        for pid in process_tree(self.process.pid):
            name = process_name(pid)
            usage[name] = usage.get(name, 0.0) + cpu_seconds(pid)
        return usage

    def peak_rss_by_process(self) -> dict[str, float]:
        """Peak RSS in MiB per process name (summed over processes of one name)."""
        peaks: dict[str, float] = {}
        for pid in process_tree(self.process.pid):
            name = process_name(pid)
            peaks[name] = peaks.get(name, 0.0) + peak_rss_mib(pid)
        return {name: mib for name, mib in peaks.items() if mib > 0}

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def ours(
    model: str,
    dtype: str,
    served: str,
    extra: list[str] | None = None,
    checkout: str | None = None,
    name: str = "ours",
    env: dict[str, str] | None = None,
) -> Server:
    """Our server; from another checkout of the repository (an older commit) if given, with
    `env` added to the environment."""
    port = free_port()
    command = [sys.executable, "-m", "runtime.cli.main", "serve", "--model", model, "--port",
               str(port), "--dtype", dtype, "--served-model-name", served, "--max-num-seqs",
               "256", "--log-level", "warning", *(extra or [])]  # fmt: skip
    env = (env or {}) | ({"PYTHONPATH": str(Path(checkout).resolve())} if checkout else {})
    return Server(name, command, port, env=env, cwd=checkout)


def vllm(venv: str, model: str, dtype: str, served: str) -> Server:
    """vLLM's CPU build with the workarounds from DEVELOPERS.md (its `vllm` CLI is broken)."""
    port = free_port()
    command = [
        str(Path(venv) / "bin" / "python"),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--served-model-name",
        served,
    ]
    return Server("vllm", command, port, env={"VLLM_CPU_KVCACHE_SPACE": "1"})


def llamacpp(venv: str, gguf: str, served: str, threads: int) -> Server:
    """llama.cpp's server as llama-cpp-python ships it, on a GGUF file as it is (its own
    quantization). It runs one request at a time: others wait in line (by default a new
    request would cut the running one short: `--interrupt_requests False`)."""
    port = free_port()
    command = [str(Path(venv) / "bin" / "python"), "-m", "llama_cpp.server", "--model", gguf,
               "--host", "127.0.0.1", "--port", str(port), "--model_alias", served,
               "--n_ctx", "2048", "--n_threads", str(threads),
               "--n_threads_batch", str(threads), "--interrupt_requests", "False"]  # fmt: skip
    return Server("llama.cpp", command, port)
