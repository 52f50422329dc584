"""How long `runtime serve` with no --model takes to answer: a cold start (an empty cache: the
default model's GGUF file is converted first) and warm starts (its converted copy is there).

    python -m benchmarks.startup [--warm 3] [--cold-kernels] [SERVE_ARGS...]

Each start is timed from launch to the "serving ... at" line (ready) and to the answer of one
chat question at temperature 0 (answer); the conversion's own time is read from the server's
log. The package download is not counted (it is installed before). --cold-kernels gives the
cold start an empty CPU-kernel cache too (their first build), as on a fresh machine. Prints
one line: the model, dtype and backend read back from the server, then the figures.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

READY = re.compile(r"serving (\S+) at (http://\S+)")
CONVERTED = re.compile(r"converted into \S+ in ([\d.]+) s")
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@dataclass(frozen=True)
class Start:
    ready: float
    answer: float
    conversion: float | None
    served: str  # "model dtype backend", read back from the server
    reply: str


def run_once(cache: Path, kernels: Path | None, serve_args: list[str]) -> Start:
    env = os.environ | {"RUNTIME_CACHE_DIR": str(cache), "PYTHONUNBUFFERED": "1"}
    if kernels is not None:
        env["RUNTIME_KERNEL_CACHE"] = str(kernels)
    command = [sys.executable, "-m", "runtime.cli.main", "serve", "--port", "0", *serve_args]
    started = time.monotonic()
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    ready = threading.Event()
    threading.Thread(target=_read, args=(proc, lines, ready), daemon=True).start()
    try:
        if not ready.wait(timeout=600) or not (match := _search(READY, lines)):
            raise RuntimeError("the server did not start:\n" + "".join(lines))
        ready_at = time.monotonic() - started
        url = match.group(2)
        reply = httpx.post(
            url + "/v1/chat/completions",
            json={"model": match.group(1), "messages": QUESTION, "temperature": 0},
            timeout=120,
        ).json()["choices"][0]["message"]["content"]
        answer_at = time.monotonic() - started
        info = httpx.get(url + "/server_info").json()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    converted = _search(CONVERTED, lines)
    served = f"{match.group(1)} {info['dtype']} {info['attention_backend']}"
    conversion = float(converted.group(1)) if converted else None
    return Start(ready_at, answer_at, conversion, served, reply)


def _read(proc: subprocess.Popen[str], lines: list[str], ready: threading.Event) -> None:
    assert proc.stderr is not None
    for line in proc.stderr:  # drained until exit, so the server never blocks on its log
        lines.append(line)
        if READY.search(line):
            ready.set()
    ready.set()


def _search(pattern: re.Pattern[str], lines: list[str]) -> re.Match[str] | None:
    return next((m for line in lines if (m := pattern.search(line))), None)


def span(values: list[float]) -> str:
    low, high = min(values), max(values)
    return f"{low:.1f} s" if round(low, 1) == round(high, 1) else f"{low:.1f}-{high:.1f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warm", type=int, default=3, help="warm starts after the cold one")
    parser.add_argument("--cold-kernels", action="store_true", help="build the CPU kernels too")
    args, serve_args = parser.parse_known_args()
    with tempfile.TemporaryDirectory(prefix="startup-") as root:
        kernels = Path(root) / "kernels" if args.cold_kernels else None
        cold = run_once(Path(root) / "cache", kernels, serve_args)
        warm = [run_once(Path(root) / "cache", kernels, serve_args) for _ in range(args.warm)]
    assert all(start.conversion is None for start in warm), "a warm start converted again"
    print(
        f"{cold.served}: cold ready {cold.ready:.1f} s (conversion {cold.conversion:.1f} s"
        f"{', kernels built' if args.cold_kernels else ''}), answer {cold.answer:.1f} s; "
        f"warm x{len(warm)} ready {span([s.ready for s in warm])}, "
        f"answer {span([s.answer for s in warm])}; reply {cold.reply!r}"
    )


if __name__ == "__main__":
    main()
