"""What a weight update or a memory release is made of, before it reaches the worker: tensors
from the caller saved as a private safetensors file, and the checks of a trainer's group, its
announcement, and the memory tags."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

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


def group_problem(master_port: int, rank_offset: int, world_size: int, workers: int) -> str:
    """What is wrong with an init_weights_update_group call ("" if nothing): the trainer is
    rank 0, and each of the `workers` (data-parallel groups) takes a rank from `rank_offset`."""
    last = rank_offset + workers - 1
    if 1 <= master_port <= 65535 and 1 <= rank_offset <= last < world_size <= 65536:
        return ""
    return (
        "need 1 <= master_port <= 65535 and 1 <= rank_offset, rank_offset + "
        f"data_parallel_size - 1 < world_size <= 65536, got {master_port}, {rank_offset}, "
        f"{world_size}"
    )


MEMORY_TAGS = ("kv_cache", "weights")


def memory_tags(tags: list[str] | None) -> tuple[str, ...]:
    """The memory a release or resume names (default: all of it), in a fixed order."""
    if tags is None:
        return MEMORY_TAGS
    unknown = sorted(set(tags) - set(MEMORY_TAGS))
    if unknown or not tags:
        raise ValueError(f"tags must be among {', '.join(MEMORY_TAGS)}, got {tags!r}")
    return tuple(t for t in MEMORY_TAGS if t in tags)


@dataclass(slots=True)
class ServedVersion:
    """Which weights serve: the checkpoint they came from and their version, as SGLang names
    them ("default" at start); tensors installed since change the version, not the path."""

    model_path: str
    weight_version: str = "default"
    checkpoint_version: str = "default"  # the version of the weights at model_path

    def loaded(self, model_path: str, weight_version: str | None) -> None:
        """A whole checkpoint serves now."""
        self.model_path = model_path
        self.weight_version = self.checkpoint_version = weight_version or self.weight_version

    def reloaded(self) -> None:
        """The weights were reloaded from their checkpoint: updates since are gone."""
        self.weight_version = self.checkpoint_version
