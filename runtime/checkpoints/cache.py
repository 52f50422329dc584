"""Where checkpoints this machine makes for itself live: generated ones, converted ones."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_root() -> Path:
    """$RUNTIME_CACHE_DIR, else $XDG_CACHE_HOME/trio-llm-runtime, else ~/.cache/trio-llm-runtime."""
    root = os.environ.get("RUNTIME_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "trio-llm-runtime"
    )
    return Path(root)


def write_atomically(target: Path, write: Callable[[Path], object]) -> None:
    """Call `write` on an empty staging folder beside `target`, then rename it to `target`, so
    that a concurrent or interrupted run sees all of it or nothing. If another run got there
    first, its copy stays and ours is dropped."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    try:
        write(staging)
        try:
            staging.rename(target)
        except OSError:
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def discard(target: Path) -> None:
    """Remove a stale copy: renamed aside first, so nobody finds it half deleted."""
    aside = target.with_name(f".stale-{target.name}-{os.getpid()}")
    try:
        target.rename(aside)
    except FileNotFoundError:
        return
    shutil.rmtree(aside, ignore_errors=True)
