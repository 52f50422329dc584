from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from quart.typing import TestClientProtocol as QuartClient
from transformers import PreTrainedTokenizerBase

from api.app import create_app
from api.http.state import ServerSettings
from runtime.checkpoints.random_model import make_tiny_model
from tests.api_helpers import MODEL
from tests.fake_engine import FakeEngine
from tests.gguf_helpers import GGUF_CASES
from tests.parity_helpers import greedy_references
from tests.server_process import ServerProcess

if not torch.cuda.is_available():
    # the Triton kernels (runtime/kernels/gpu*.py) run in Triton's interpreter, on the CPU;
    # read when they are defined, so before any test imports them (nothing above does)
    os.environ.setdefault("TRITON_INTERPRET", "1")

# CI runs the same examples every time (a failure there reproduces); elsewhere each run
# draws new ones, which is how new failures are found. No deadline: a loaded 2-core
# machine makes any per-example time limit flaky.
SLOW_MACHINE = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
settings.register_profile("ci", derandomize=True, print_blob=True, **SLOW_MACHINE)
settings.register_profile("local", **SLOW_MACHINE)
settings.load_profile("ci" if os.environ.get("CI") else "local")

ARCHS = ("llama", "qwen2", "qwen3")


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One deterministic tiny checkpoint per architecture, written once per test session."""
    root = tmp_path_factory.mktemp("models")
    return {arch: make_tiny_model(root / arch, arch, seed=0) for arch in ARCHS}


@pytest.fixture(scope="session")
def llama_dir(model_dirs: dict[str, Path]) -> Path:
    return model_dirs["llama"]


@pytest.fixture(scope="session", autouse=True)
def runtime_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """RUNTIME_CACHE_DIR for the whole session, servers it starts included: GGUF files are
    converted once per session, and never into the user's own cache."""
    root = tmp_path_factory.mktemp("runtime-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RUNTIME_CACHE_DIR", str(root))
        yield root


@pytest.fixture(scope="session")
def gguf_files(
    model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """The tiny checkpoints as quantized GGUF files (tests/gguf_helpers.py), written once."""
    from tools.gguf_writer import write_gguf

    root = tmp_path_factory.mktemp("gguf")
    return {
        name: write_gguf(model_dirs[case.arch], root / f"{name}.gguf", case.qtype, case.pre)
        for name, case in GGUF_CASES.items()
    }


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The default model's GGUF file; the README's test command installs its package."""
    from runtime.checkpoints.default_model import DefaultModelMissing, default_model_file

    try:
        return default_model_file()
    except DefaultModelMissing as exc:
        pytest.fail(str(exc))


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf: Path, runtime_cache: Path) -> Path:
    """SmolLM2 converted once per session into the session's cache (about 2 s), where the
    servers the tests start without --model find it."""
    from runtime.checkpoints.gguf import resolve_checkpoint

    return Path(resolve_checkpoint(str(smollm2_gguf)))


@pytest.fixture(scope="session")
def smollm2_server(smollm2_dir: Path) -> Iterator[ServerProcess]:
    """`runtime serve` with no --model (SmolLM2), shared by the tests of the default model
    and of tool calling: float32, as transformers computes the references (auto would pick
    bfloat16 on a CPU with native bf16), with tool_choice "auto" enabled."""
    proc = ServerProcess(
        None, "--dtype", "float32", "--max-model-len", "1024",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
    )  # fmt: skip
    try:
        yield proc
    finally:
        proc.terminate()


@pytest.fixture(scope="session")
def smollm2_reference_tokenizer(smollm2_gguf: Path) -> PreTrainedTokenizerBase:
    """transformers' own tokenizer from the GGUF file (about 3 s)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="session")
def references(model_dirs: dict[str, Path]) -> dict[str, list[list[int]]]:
    """transformers' greedy continuation of SHARED and each of `prompt_set()`, per
    architecture (tests/parity_helpers.py)."""
    return greedy_references(model_dirs, ARCHS)


@pytest.fixture(scope="session")
def control_server(
    llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """`runtime serve` on the tiny llama in float32, with --enable-control-api: shared by the
    end-to-end tests of steering (each leaves it unpaused, with its memory resident). Its
    output root is pytest's base folder: each test's tmp_path is a folder directly in it. It
    streams /generate cumulatively, as docs/rl-frameworks.md tells slime's users to."""
    root = str(tmp_path_factory.getbasetemp())
    proc = ServerProcess(
        llama_dir, "--dtype", "float32", "--enable-control-api", "--output-root", root,
        "--cumulative-streaming-output",
    )  # fmt: skip
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
