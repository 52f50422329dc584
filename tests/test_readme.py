"""The README's commands are the ones CI runs."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command() -> None:
    ci_command = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    readme = (ROOT / "README.md").read_text()
    assert ci_command in readme
    assert ci_command.endswith("pytest") and "torch==2.13.0" in ci_command


def test_readme_serve_command_installs_torch_first() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "pip install torch==2.13.0 -e . && runtime serve" in readme
