"""The examples run as documented (small sizes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.server_process import ServerProcess

ROOT = Path(__file__).resolve().parent.parent


def test_rl_loop_runs(llama_dir: Path) -> None:
    command = [sys.executable, "examples/rl_loop.py", "--model", str(llama_dir), "--steps", "2",
               "--rollouts", "4", "--max-tokens", "8"]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines()[1:]]
    assert [row[0] for row in rows] == ["1", "2"]
    assert [row[-1] for row in rows] == ["step-1", "step-2"]
    assert all(float(row[1]) > 0 for row in rows)  # rollout tokens per second


def test_tool_loop_runs(smollm2_server: ServerProcess) -> None:
    command = [sys.executable, "examples/tool_loop.py", "--url", smollm2_server.url]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "user: What is the weather in Paris?"
    assert lines[1].startswith('tool: get_weather({"city": "Paris"') and "sunny" in lines[1]
    assert lines[2].startswith("assistant: ") and len(lines[2]) > len("assistant: ")
