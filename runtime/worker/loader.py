"""Load Hugging Face safetensors checkpoints into our models, strictly.

Checkpoint names map to ours one to one, except the projections we fuse (the model's
`packed_modules`: `q_proj` lands in a slice of `qkv_proj`, and so on). Every parameter must be
filled exactly once with a tensor of exactly its shape; anything else is a `CheckpointError`
naming the tensor, so a wrong or truncated checkpoint never serves garbage.

A parameter kept as GGUF blocks (runtime/layers/quantized.py) takes either its float matrix,
quantized as it is copied (`--quantization int8`, and float weights pushed into a quantized
model), or uint8 blocks of its own format (a GGUF file's, converted with its blocks kept),
whose shape says the format: [rows, row_bytes].
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from runtime.kernels.quant_formats import scales_finite
from runtime.layers.parallel import ColumnParallelLinear, Slot, whole

log = logging.getLogger(__name__)

# Buffers some checkpoints carry that we recompute ourselves.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """The checkpoint does not match the model: a tensor is missing, unexpected or misshapen."""


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / shard for shard in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {model_dir}")
    return files


def iter_slices(files: list[Path]) -> Iterator[tuple[str, Any]]:
    """Every tensor of the checkpoint as a lazy safetensors slice: only what is taken from it
    is read (a tensor-parallel rank reads its share)."""
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_slice(name)


def count_tensors(files: list[Path]) -> int:
    total = 0
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            total += len(f.keys())
    return total


# safetensors' dtype names
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
BLOCKS = {"U8": torch.uint8}  # GGUF blocks, for a parameter kept as blocks


def load_weights(
    model: nn.Module,
    model_dir: str | Path,
    progress: bool = False,
    dtypes: Collection[torch.dtype] | None = None,
) -> frozenset[torch.dtype]:
    """Copy every tensor of the checkpoint into `model`, checking names, shapes, finite
    values and (if `dtypes` is given) dtypes; returns the dtypes the checkpoint had. With
    `progress`: a bar where stderr is a terminal (never carriage returns in a log file), and
    a line once loaded."""
    started = time.monotonic()
    files = safetensors_files(Path(model_dir))
    params = dict(model.named_parameters())
    packed = _packed(model)
    tied = getattr(getattr(model, "args", None), "tie_word_embeddings", False)
    wanted = _wanted(model) - {("lm_head.weight", None)} if tied else _wanted(model)
    loaded: set[tuple[str, int | None]] = set()
    seen: set[torch.dtype] = set()
    tensors = iter_slices(files)
    if progress:
        total = count_tensors(files)  # disable=None: no bar unless stderr is a terminal
        tensors = tqdm(tensors, total=total, desc="Loading weights", unit="tensor", disable=None)
    with torch.no_grad():
        for name, source in tensors:
            if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
                continue
            target, shard = _map_name(name, packed)
            if target not in params:
                raise CheckpointError(f"checkpoint tensor {name!r} has no place in the model")
            slot = _slot(model, target, shard)
            dtype = _source_dtype(name, source.get_dtype(), slot)
            if dtype != torch.uint8:
                check_dtype(name, dtype, dtypes)
                seen.add(dtype)
            shape = slot.source_shape(dtype)
            if tuple(source.get_shape()) != shape:
                raise CheckpointError(
                    f"{name}: checkpoint shape {tuple(source.get_shape())} != model shape "
                    f"{shape}{_blocks_of(slot, dtype)}"
                )
            if (target, shard) in loaded:
                raise CheckpointError(f"checkpoint tensor {name!r} appears twice")
            slot.write(source)
            check_written(name, slot)
            loaded.add((target, shard))
    missing = wanted - loaded
    if missing:
        names = sorted(_source_name(t, s, packed) for t, s in missing)
        raise CheckpointError(f"checkpoint lacks {len(names)} tensors, e.g. {names[:5]}")
    if progress:
        seconds = time.monotonic() - started
        log.info("loaded %d tensors from %s in %.1f s", len(loaded), model_dir, seconds)
    return frozenset(seen)


def check_dtype(name: str, dtype: torch.dtype, dtypes: Collection[torch.dtype] | None) -> None:
    """A tensor comes in a dtype the served weights came in (or are served in), else it is
    refused rather than cast: new weights are what they claim to be."""
    if dtypes is not None and dtype not in dtypes:
        expected = " or ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
        raise CheckpointError(
            f"{name}: dtype {str(dtype).removeprefix('torch.')}, but the served weights are "
            f"{expected} (--allow-weight-cast lets it be cast)"
        )


def check_finite(name: str, tensor: torch.Tensor) -> None:
    """NaN or infinite weights would end every request at once with garbage: refused."""
    if tensor.dtype == torch.uint8:
        return  # blocks: their scales are checked where their format is known
    if not bool(torch.isfinite(tensor).all()):
        raise CheckpointError(f"{name}: holds NaN or infinite values")


def check_written(name: str, slot: Slot) -> None:
    """The values just written are finite: floats, or the scales of blocks."""
    if slot.quant is None:
        check_finite(name, slot.dest)
    elif not scales_finite(slot.dest, slot.quant.name):
        raise CheckpointError(f"{name}: holds NaN or infinite values")


def _source_dtype(name: str, dtype_name: str, slot: Slot) -> torch.dtype:
    dtype = DTYPES.get(dtype_name) or (BLOCKS.get(dtype_name) if slot.quant else None)
    if dtype is None:
        raise CheckpointError(f"{name}: dtype {dtype_name} is not floating point")
    return dtype


def _blocks_of(slot: Slot, dtype: torch.dtype) -> str:
    """What a uint8 tensor for a parameter kept as blocks should have been."""
    if slot.quant is None or dtype != torch.uint8:
        return ""
    return f" ({slot.quant.name} blocks of a {slot.full_shape} matrix: another format?)"


def install_tensors(
    model: nn.Module,
    tensors: Iterable[tuple[str, torch.Tensor]],
    dtypes: Collection[torch.dtype] | None = None,
) -> int:
    """Copy named tensors (checkpoint names, or ours) over the model's weights: a partial
    update, as a trainer pushes them. Every tensor is checked (a known name, once, its exact
    shape, a dtype among `dtypes` if given, finite values) before any is copied, so on a
    `CheckpointError` nothing changed. Returns how many were installed."""
    plan: list[tuple[str, Slot, torch.Tensor]] = []
    for name, tensor in tensors:
        slot = check_tensor(model, name, tensor.shape, tensor.dtype, dtypes)
        if slot is not None:
            check_finite(name, tensor)
            if slot.quant is not None and tensor.dtype == torch.uint8:
                check_blocks(name, tensor, slot)
            plan.append((name, slot, tensor))
    check_disjoint([(name, slot.dest) for name, slot, _ in plan])
    with torch.no_grad():
        for _, slot, tensor in plan:
            slot.write(tensor)
    return len(plan)


def check_blocks(name: str, blocks: torch.Tensor, slot: Slot) -> None:
    assert slot.quant is not None
    if not scales_finite(blocks, slot.quant.name):
        raise CheckpointError(f"{name}: holds NaN or infinite values")


def check_tensor(
    model: nn.Module,
    name: str,
    shape: Sequence[int],
    dtype: torch.dtype,
    dtypes: Collection[torch.dtype] | None = None,
) -> Slot | None:
    """Where `name` updates the model, if a tensor of `shape` and `dtype` fits it (None
    for what checkpoints carry and we ignore: a tied LM head, rotary buffers); else a
    `CheckpointError` naming what does not fit."""
    tied = getattr(getattr(model, "args", None), "tie_word_embeddings", False)
    if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
        return None
    try:
        slot = find_slot(model, name)
    except KeyError:
        raise CheckpointError(f"tensor {name!r} has no place in the model") from None
    blocks = slot.quant is not None and dtype == torch.uint8
    if not dtype.is_floating_point and not blocks:
        raise CheckpointError(f"{name}: dtype {dtype} is not a floating point type")
    if not blocks:
        check_dtype(name, dtype, dtypes)
    expected = slot.source_shape(dtype)
    if expected != tuple(shape):
        raise CheckpointError(
            f"{name}: shape {tuple(shape)} != model shape {expected}{_blocks_of(slot, dtype)}"
        )
    return slot


def check_disjoint(targets: list[tuple[str, torch.Tensor]]) -> None:
    """No two names may write the same memory (a tensor twice, or a fused parameter and one
    of its slices): which one won would depend on the order."""
    spans = sorted(
        (dest.data_ptr(), dest.data_ptr() + dest.numel() * dest.element_size(), name)
        for name, dest in targets
    )
    for (_, end, first), (start, _, second) in pairwise(spans):
        if start < end:
            raise CheckpointError(f"tensors {first!r} and {second!r} update the same weights")


def find_slot(model: nn.Module, name: str) -> Slot:
    """Where a parameter, by its checkpoint name (a part of a fused one) or by ours, lives on
    this rank; KeyError if the model has none."""
    params = dict(model.named_parameters())
    target, shard = (name, None) if name in params else _map_name(name, _packed(model))
    if target not in params:
        raise KeyError(f"the model has no parameter {name!r}")
    return _slot(model, target, shard)


def _slot(model: nn.Module, target: str, shard: int | None) -> Slot:
    """A sharded layer says where a rank's share goes; any other parameter is whole. A weight
    kept as blocks says so in its slot."""
    module_name, _, param = target.rpartition(".")
    module = model.get_submodule(module_name)
    slot: Callable[[str, int | None], Slot] | None = getattr(module, "slot", None)
    if slot is None:
        return whole(getattr(module, param).data)
    found = slot(param, shard)
    quant = getattr(module, "quant", None)
    return dataclasses.replace(found, quant=quant) if quant and param == "weight" else found


def _packed(model: nn.Module) -> dict[str, tuple[str, int]]:
    return getattr(model, "packed_modules", {})


def _map_name(name: str, packed: dict[str, tuple[str, int]]) -> tuple[str, int | None]:
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in packed:
            fused, shard = packed[part]
            return ".".join([*parts[:i], fused, *parts[i + 1 :]]), shard
    return name, None


def _wanted(model: nn.Module) -> set[tuple[str, int | None]]:
    """Every (parameter, shard) the checkpoint must fill."""
    wanted: set[tuple[str, int | None]] = set()
    for module_name, module in model.named_modules():
        for param_name, _ in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            if isinstance(module, ColumnParallelLinear):
                wanted.update((name, i) for i in range(len(module.parts)))
            else:
                wanted.add((name, None))
    return wanted


def _source_name(target: str, shard: int | None, packed: dict[str, tuple[str, int]]) -> str:
    if shard is None:
        return target
    for source, (fused, index) in packed.items():
        if index == shard and f".{fused}." in target:
            return target.replace(f".{fused}.", f".{source}.")
    return target
