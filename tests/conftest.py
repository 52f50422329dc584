from __future__ import annotations

from pathlib import Path

import pytest

from tools.tiny_model import make_tiny_model

ARCHS = ("llama", "qwen2", "qwen3")


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One deterministic tiny checkpoint per architecture, written once per test session."""
    root = tmp_path_factory.mktemp("models")
    return {arch: make_tiny_model(root / arch, arch, seed=0) for arch in ARCHS}


@pytest.fixture(scope="session")
def llama_dir(model_dirs: dict[str, Path]) -> Path:
    return model_dirs["llama"]
