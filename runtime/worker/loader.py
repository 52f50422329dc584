"""Load Hugging Face safetensors checkpoints into our models, strictly.

Checkpoint names map to ours one to one, except the projections we fuse (the model's
`packed_modules`: `q_proj` lands in a slice of `qkv_proj`, and so on). Every parameter must be
filled exactly once with a tensor of exactly its shape; anything else is a `CheckpointError`
naming the tensor, so a wrong or truncated checkpoint never serves garbage.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from itertools import pairwise
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from runtime.layers.basic import FusedLinear

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


def iter_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)


def count_tensors(files: list[Path]) -> int:
    total = 0
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            total += len(f.keys())
    return total


def load_weights(model: nn.Module, model_dir: str | Path, progress: bool = False) -> None:
    """Copy every tensor of the checkpoint into `model`, checking names and shapes."""
    files = safetensors_files(Path(model_dir))
    params = dict(model.named_parameters())
    packed: dict[str, tuple[str, int]] = getattr(model, "packed_modules", {})
    tied = getattr(getattr(model, "args", None), "tie_word_embeddings", False)
    wanted = _wanted(model) - {("lm_head.weight", None)} if tied else _wanted(model)
    loaded: set[tuple[str, int | None]] = set()
    tensors = iter_tensors(files)
    if progress:
        tensors = tqdm(tensors, total=count_tensors(files), desc="Loading weights", unit="tensor")
    with torch.no_grad():
        for name, tensor in tensors:
            if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
                continue
            target, shard = _map_name(name, packed)
            if target not in params:
                raise CheckpointError(f"checkpoint tensor {name!r} has no place in the model")
            dest = params[target].data
            if shard is not None:
                dest = _owner(model, target).shard(dest, shard)
            if not tensor.is_floating_point():
                raise CheckpointError(f"{name}: dtype {tensor.dtype} is not a floating point type")
            if dest.shape != tensor.shape:
                raise CheckpointError(
                    f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape "
                    f"{tuple(dest.shape)}"
                )
            if (target, shard) in loaded:
                raise CheckpointError(f"checkpoint tensor {name!r} appears twice")
            dest.copy_(tensor)
            loaded.add((target, shard))
    missing = wanted - loaded
    if missing:
        names = sorted(_source_name(t, s, packed) for t, s in missing)
        raise CheckpointError(f"checkpoint lacks {len(names)} tensors, e.g. {names[:5]}")


def install_tensors(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy named tensors (checkpoint names, or ours) over the model's weights: a partial
    update, as a trainer pushes them. Every tensor is checked (a known name, once, its exact
    shape, a floating dtype) before any is copied, so on a `CheckpointError` nothing changed.
    Returns how many were installed."""
    plan: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    for name, tensor in tensors:
        dest = check_tensor(model, name, tensor.shape, tensor.dtype)
        if dest is not None:
            plan.append((name, dest, tensor))
    check_disjoint([(name, dest) for name, dest, _ in plan])
    with torch.no_grad():
        for _, dest, tensor in plan:
            dest.copy_(tensor)
    return len(plan)


def check_tensor(
    model: nn.Module, name: str, shape: Sequence[int], dtype: torch.dtype
) -> torch.Tensor | None:
    """The model's tensor that `name` updates, if a tensor of `shape` and `dtype` fits it (None
    for what checkpoints carry and we ignore: a tied LM head, rotary buffers); else a
    `CheckpointError` naming what does not fit."""
    tied = getattr(getattr(model, "args", None), "tie_word_embeddings", False)
    if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
        return None
    try:
        dest = find_parameter(model, name)
    except KeyError:
        raise CheckpointError(f"tensor {name!r} has no place in the model") from None
    if not dtype.is_floating_point:
        raise CheckpointError(f"{name}: dtype {dtype} is not a floating point type")
    if tuple(dest.shape) != tuple(shape):
        raise CheckpointError(f"{name}: shape {tuple(shape)} != model shape {tuple(dest.shape)}")
    return dest


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


def find_parameter(model: nn.Module, name: str) -> torch.Tensor:
    """A parameter by its checkpoint name (a slice of a fused one) or by ours; KeyError if
    the model has none."""
    params = dict(model.named_parameters())
    if name in params:
        return params[name].data
    target, shard = _map_name(name, getattr(model, "packed_modules", {}))
    if target not in params:
        raise KeyError(f"the model has no parameter {name!r}")
    tensor = params[target].data
    return tensor if shard is None else _owner(model, target).shard(tensor, shard)


def _map_name(name: str, packed: dict[str, tuple[str, int]]) -> tuple[str, int | None]:
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in packed:
            fused, shard = packed[part]
            return ".".join([*parts[:i], fused, *parts[i + 1 :]]), shard
    return name, None


def _owner(model: nn.Module, param_name: str) -> FusedLinear:
    module = model.get_submodule(param_name.rsplit(".", 1)[0])
    assert isinstance(module, FusedLinear), param_name
    return module


def _wanted(model: nn.Module) -> set[tuple[str, int | None]]:
    """Every (parameter, shard) the checkpoint must fill."""
    wanted: set[tuple[str, int | None]] = set()
    for module_name, module in model.named_modules():
        for param_name, _ in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            if isinstance(module, FusedLinear):
                wanted.update((name, i) for i in range(len(module.shard_sizes)))
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
