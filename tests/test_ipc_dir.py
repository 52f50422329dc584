"""No ipc:// folder outlives its server, however the server ends."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from runtime.processes import ipc_dir


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
