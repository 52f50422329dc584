"""Private folders for the actors' ipc:// sockets, removed on every exit path.

A folder is named after the process that made it: `/tmp/rt-<pid>-<random>` (unix socket paths
must stay short, so no deeper). A normal exit removes it as the supervisor's nursery closes;
the exits that skip `finally` blocks (`os._exit` from the hard-exit watchdog or a second signal)
call `remove_all()` first; a SIGKILL can do nothing, so each new folder's maker first sweeps the
folders whose maker is dead.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

ROOT = "/tmp"
_PREFIX = "rt-"

_made: set[str] = set()


def make() -> str:
    """A fresh private folder for this process's actors."""
    sweep_stale()
    directory = tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=ROOT)
    _made.add(directory)
    return directory


def remove(directory: str) -> None:
    shutil.rmtree(directory, ignore_errors=True)
    _made.discard(directory)


def remove_all() -> None:
    """Before an exit that runs no `finally`: this process's folders go now."""
    for directory in list(_made):
        remove(directory)


def sweep_stale(root: str = ROOT) -> list[str]:
    """Remove the folders of makers that are gone (killed with SIGKILL); return them."""
    removed = []
    for path in Path(root).glob(f"{_PREFIX}*-*"):
        pid = path.name.removeprefix(_PREFIX).split("-", 1)[0]
        if pid.isdigit() and _only_sockets(path) and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    return removed


def _only_sockets(path: Path) -> bool:
    """Ours: a folder (not a link) holding nothing but .ipc sockets (and the .store file
    where tensor-parallel ranks meet)."""
    try:
        return (
            path.is_dir()
            and not path.is_symlink()
            and all(entry.suffix in (".ipc", ".store") for entry in path.iterdir())
        )
    except OSError:
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: not ours to judge
    return True
