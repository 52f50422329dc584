"""The tiny random Llama, generated on first use into the cache: the default model of the
benchmarks and examples that need no real weights. `runtime serve` serves it only by path."""

from __future__ import annotations

from pathlib import Path

from runtime.checkpoints.cache import cache_root, write_atomically

# Bump when random_model.py changes what it writes, so stale caches are not reused.
BUILTIN_VERSION = "tiny-llama-v1"


def builtin_model_dir() -> Path:
    """Path of the tiny checkpoint, writing it first if this machine has none yet."""
    from runtime.checkpoints.random_model import make_tiny_model

    target = cache_root() / BUILTIN_VERSION
    if not (target / "model.safetensors").is_file():
        write_atomically(target, lambda staging: make_tiny_model(staging, "llama", seed=0))
    return target
