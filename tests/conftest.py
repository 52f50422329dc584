from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import torch
from quart.typing import TestClientProtocol as QuartClient

from api.app import create_app
from api.http.state import ServerSettings
from runtime.checkpoints.random_model import make_tiny_model
from tests.api_helpers import MODEL
from tests.fake_engine import FakeEngine
from tests.parity_helpers import greedy_references
from tests.server_process import ServerProcess

if not torch.cuda.is_available():
    # the Triton kernels (runtime/kernels/gpu*.py) run in Triton's interpreter, on the CPU;
    # read when they are defined, so before any test imports them (nothing above does)
    os.environ.setdefault("TRITON_INTERPRET", "1")

ARCHS = ("llama", "qwen2", "qwen3")


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One deterministic tiny checkpoint per architecture, written once per test session."""
    root = tmp_path_factory.mktemp("models")
    return {arch: make_tiny_model(root / arch, arch, seed=0) for arch in ARCHS}


@pytest.fixture(scope="session")
def llama_dir(model_dirs: dict[str, Path]) -> Path:
    return model_dirs["llama"]


@pytest.fixture(scope="session")
def references(model_dirs: dict[str, Path]) -> dict[str, list[list[int]]]:
    """transformers' greedy continuation of SHARED and each of `prompt_set()`, per
    architecture (tests/parity_helpers.py)."""
    return greedy_references(model_dirs, ARCHS)


@pytest.fixture(scope="session")
def control_server(llama_dir: Path) -> Iterator[ServerProcess]:
    """`runtime serve` on the tiny llama in float32, with --enable-control-api: shared by the
    end-to-end tests of steering (each leaves it unpaused, with its memory resident)."""
    proc = ServerProcess(llama_dir, "--dtype", "float32", "--enable-control-api")
    yield proc
    proc.terminate()


# -- the HTTP layer against a fake engine (tests/test_api*.py) --------------------------------


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
async def client(engine: FakeEngine) -> AsyncIterator[QuartClient]:
    app = create_app(engine, ServerSettings(served_model_name=MODEL))
    async with app.test_app() as test_app:
        yield test_app.test_client()
