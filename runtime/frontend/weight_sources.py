"""What a weight update is made of, before it reaches the worker: tensors from the caller
saved as a private safetensors file, and the checks of a trainer's announcement."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

from runtime.protocol import MAX_TENSOR_DIM, NamedTensors


@contextmanager
def temporary_file(suffix: str) -> Iterator[str]:
    """A fresh file only we may read (mode 0600), removed afterwards."""
    fd, path = tempfile.mkstemp(prefix="rt-weights-", suffix=suffix)
    os.close(fd)
    try:
        yield path
    finally:
        os.unlink(path)


def save_safetensors(tensors: NamedTensors, path: str) -> None:
    from safetensors.torch import save_file  # the frontend needs torch only for this

    pairs = tensors.items() if isinstance(tensors, Mapping) else tensors
    save_file({name: tensor.detach().cpu().contiguous() for name, tensor in pairs}, path)


def announcement_problem(
    names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]
) -> str:
    """What is wrong with an update_weights_from_distributed announcement ("" if nothing)."""
    if not len(names) == len(dtypes) == len(shapes):
        return (
            f"names, dtypes and shapes differ in length: {len(names)}, {len(dtypes)}, {len(shapes)}"
        )
    for name, shape in zip(names, shapes, strict=True):
        if not all(type(d) is int and 0 <= d <= MAX_TENSOR_DIM for d in shape):
            return f"{name}: shape {list(shape)} is not a list of sizes in [0, {MAX_TENSOR_DIM}]"
    return ""
