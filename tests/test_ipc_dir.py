"""No ipc:// folder outlives its server, however the server ends."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime import ipc_dir
from runtime.cli import api_key, build_parser


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_folders_of_dead_makers_are_swept(tmp_path: Path) -> None:
    stale = tmp_path / f"rt-{dead_pid()}-abc"
    mine = tmp_path / f"rt-{os.getpid()}-def"
    other = tmp_path / "rt-notapid-x"
    for folder in (stale, mine, other):
        folder.mkdir()
        (folder / "worker.ipc").touch()
    assert ipc_dir.sweep_stale(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and mine.exists() and other.exists()


def test_exits_without_finally_remove_this_process_folders() -> None:
    folder = ipc_dir.make()
    assert Path(folder).name.startswith(f"rt-{os.getpid()}-")
    ipc_dir.remove_all()
    assert not Path(folder).exists()


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
