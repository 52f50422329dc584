"""The served weights: one rank's share of the model, where it came from, and every change to it.

A change never half-applies: a new checkpoint loads into a fresh model that takes over only
once it loaded whole (`candidate`, then `serve`); tensors pushed over the served ones are all
checked (names, shapes, dtypes, no two writing the same memory) before any is copied
(`check`, then `install`). Released weights (`release`) come back from where they last came
from (`resume`). With tensor parallelism each rank holds one of these for its share, and
runtime/worker/control.py keeps the ranks in step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from safetensors import safe_open
from torch import nn

from runtime.checkpoints.model_info import ModelInfo
from runtime.kernels.select import Kernels, streamed_linear
from runtime.layers.basic import pack_linears_for_cpu
from runtime.layers.parallel import Slot, TPGroup
from runtime.models import MODELS
from runtime.models.llama import ModelArgs
from runtime.worker.loader import (
    CheckpointError,
    check_disjoint,
    check_tensor,
    find_slot,
    install_tensors,
    load_weights,
)

TensorSpec = tuple[str, torch.dtype, tuple[int, ...]]  # name, dtype, shape
RELEASED = "the weights are released: resume_memory_occupation first"


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What a copy of the served model is built from."""

    info: ModelInfo
    args: ModelArgs
    max_model_len: int
    tp: TPGroup
    device: torch.device
    kernels: Kernels | None

    def build(self, model_dir: str, progress: bool = False) -> nn.Module:
        """Our model, shaped as the served one, with the checkpoint's weights (strictly)."""
        architecture = MODELS[self.info.architecture]
        model = architecture(self.args, self.info.hf_config, self.max_model_len, self.tp)
        model.to(device=self.device, dtype=self.info.dtype)
        load_weights(model, model_dir, progress=progress)
        self.pack(model)
        return model.eval()

    def pack(self, model: nn.Module) -> None:
        """(Re)make the CPU kernels' packed copies of the linear layers' weights."""
        if self.device.type == "cpu":
            pack_linears_for_cpu(model, streamed_linear(self.kernels))


class ServedWeights:
    def __init__(self, shape: ModelShape, model_dir: str, progress: bool = False) -> None:
        self.shape = shape
        self.path = model_dir  # where the served weights came from
        self.model: nn.Module | None = shape.build(model_dir, progress)  # None: released

    def candidate(self, model_dir: str) -> tuple[nn.Module | None, str]:
        """The model with the weights of `model_dir`, not serving yet; or what is wrong."""
        try:
            return self.shape.build(model_dir), ""
        except Exception as exc:  # a bad path must never stop the worker
            return None, f"{type(exc).__name__}: {exc}"

    def serve(self, model: nn.Module, model_dir: str) -> None:
        self.model, self.path = model, model_dir

    def release(self) -> None:
        self.model = None

    def resume(self) -> str:
        """Reload the weights from where they last came from, if released; "" or what went
        wrong (the checkpoint is gone...), and then they stay released."""
        if self.model is None:
            model, error = self.candidate(self.path)
            if error:
                return error
            self.model = model
        return ""

    def read_file(self, path: str) -> tuple[list[tuple[str, torch.Tensor]], str]:
        """The named tensors of a safetensors file, or what is wrong with it."""
        try:
            with safe_open(path, framework="pt", device=str(self.shape.device)) as f:
                return [(name, f.get_tensor(name)) for name in f.keys()], ""  # noqa: SIM118
        except Exception as exc:  # not a safetensors file: the worker carries on
            return [], f"not a readable safetensors file: {type(exc).__name__}: {exc}"

    def check(self, specs: Sequence[TensorSpec]) -> str:
        """ "" if tensors of these names, dtypes and shapes would install; else what is wrong."""
        if self.model is None:
            return RELEASED
        try:
            slots = [
                (name, check_tensor(self.model, name, shape, dtype)) for name, dtype, shape in specs
            ]
            check_disjoint([(name, slot.dest) for name, slot in slots if slot is not None])
        except CheckpointError as exc:
            return str(exc)
        return ""

    def install(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
        """Copy named tensors over the served weights (some or all of them). Returns "" or
        what is wrong, and then nothing changed."""
        if self.model is None:
            return RELEASED
        try:
            install_tensors(self.model, tensors)
        except CheckpointError as exc:
            return str(exc)
        self.shape.pack(self.model)  # the packed copies are of the old weights
        return ""

    def install_file(self, path: str) -> str:
        """`install` from a safetensors file."""
        tensors, error = self.read_file(path)
        return error or self.install(tensors)

    def slot(self, name: str) -> Slot:
        """Where a parameter (checkpoint name or ours) lives on this rank; KeyError naming
        what is wrong."""
        if self.model is None:
            raise KeyError(RELEASED)
        return find_slot(self.model, name)
