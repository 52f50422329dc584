"""The built-in model: the tiny Llama checkpoint, generated on first use into a cache dir."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

# Bump when tools/tiny_model.py changes what it writes, so stale caches are not reused.
BUILTIN_VERSION = "tiny-llama-v1"


def cache_root() -> Path:
    root = os.environ.get("RUNTIME_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "trio-llm-runtime"
    )
    return Path(root)


def builtin_model_dir() -> Path:
    """Path of the built-in checkpoint, writing it first if this machine has none yet."""
    from runtime.checkpoints.random_model import make_tiny_model

    target = cache_root() / BUILTIN_VERSION
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    try:
        make_tiny_model(staging, "llama", seed=0)
        try:
            staging.rename(target)  # atomic: a concurrent first run sees all or nothing
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
