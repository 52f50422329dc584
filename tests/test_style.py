"""Lint, format, types and file size are part of the test command, so CI enforces them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["runtime", "api", "tools", "benchmarks", "tests"]
MAX_LINES = 400  # one concept per file (../shared/STYLE.md)


def run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is a dev dependency")
def test_ruff_lint_and_format() -> None:
    lint = run("ruff", "check", *PACKAGES)
    assert lint.returncode == 0, lint.stdout
    fmt = run("ruff", "format", "--check", *PACKAGES)
    assert fmt.returncode == 0, fmt.stdout


def test_mypy() -> None:
    result = run(sys.executable, "-m", "mypy", "runtime", "api", "tools", "benchmarks")
    assert result.returncode == 0, result.stdout


def test_no_source_file_is_too_long() -> None:
    long = [
        f"{path.relative_to(ROOT)}: {n} lines"
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    ]
    assert not long, long
