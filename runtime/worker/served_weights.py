"""The served weights: one rank's share of the model, where it came from, and every change to it.

A change never half-applies: a new checkpoint loads into a fresh model that takes over only
once it loaded whole (`candidate`, then `serve`); tensors pushed over the served ones are all
checked (names, shapes, dtypes, no two writing the same memory) before any is copied
(`check`, then `install`). Released weights (`release`) come back from where they last came
from (`resume`). With tensor parallelism each rank holds one of these for its share, and
runtime/worker/control.py keeps the ranks in step.
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Collection, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from runtime.checkpoints.model_info import ModelInfo
from runtime.kernels.select import Kernels, quant_kernels, streamed_linear
from runtime.layers.basic import pack_linears_for_cpu
from runtime.layers.decode_layers import install as install_decode_layers
from runtime.layers.parallel import Slot, TPGroup, VocabParallelEmbedding
from runtime.models import MODELS
from runtime.models.llama import ModelArgs
from runtime.worker.huge_pages import gather_packed_copies
from runtime.worker.loader import (
    CheckpointError,
    check_disjoint,
    check_finite,
    check_tensor,
    find_slot,
    install_tensors,
    load_weights,
)
from runtime.worker.quantization import QuantPlan

TensorSpec = tuple[str, torch.dtype, tuple[int, ...]]  # name, dtype, shape
RELEASED = "the weights are released: resume_memory_occupation first"
READ_TIMEOUT = 600.0  # seconds a checkpoint may take to load: a 70B one reads in minutes


def check_regular_files(path: str) -> None:
    """A checkpoint's files are regular files: a FIFO or a device would block the read
    forever, or never end (ValueError naming it)."""
    target = Path(path)
    for file in sorted(target.glob("*.safetensors")) if target.is_dir() else [target]:
        if not stat.S_ISREG(os.stat(file).st_mode):  # FileNotFoundError if it is not there
            raise ValueError(f"{file} is not a regular file")


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What a copy of the served model is built from."""

    info: ModelInfo
    args: ModelArgs
    max_model_len: int
    tp: TPGroup
    device: torch.device
    kernels: Kernels | None
    quantization: QuantPlan | None = None  # which matrices are kept as GGUF blocks

    def build(
        self,
        model_dir: str,
        progress: bool = False,
        dtypes: Collection[torch.dtype] | None = None,
    ) -> tuple[nn.Module, frozenset[torch.dtype]]:
        """Our model, shaped as the served one, with the checkpoint's weights (strictly; of
        `dtypes` if given), and the dtypes the checkpoint had."""
        check_regular_files(model_dir)
        architecture = MODELS[self.info.architecture]
        model = architecture(self.args, self.info.hf_config, self.max_model_len, self.tp)
        if self.quantization is not None:
            self.quantization.apply(model, self.info.dtype)
        model.to(device=self.device, dtype=self.info.dtype)  # blocks stay uint8
        found = load_weights(model, model_dir, progress=progress, dtypes=dtypes)
        self.pack(model)
        return model.eval(), found

    def pack(self, model: nn.Module) -> None:
        """(Re)make the CPU kernels' packed copies of the linear layers' weights."""
        if self.device.type == "cpu":
            kernels = quant_kernels(self.kernels)
            pack_linears_for_cpu(model, streamed_linear(self.kernels), kernels, kernels)
            gather_packed_copies(model)
            install_decode_layers(model, kernels)  # the addresses of the weights just packed
            for module in model.modules():
                if isinstance(module, VocabParallelEmbedding):
                    module.quant_kernels = kernels  # blocks' rows looked up by the kernel


class ServedWeights:
    def __init__(
        self, shape: ModelShape, model_dir: str, progress: bool = False, cast: bool = False
    ) -> None:
        self.shape = shape
        self.path = model_dir  # where the served weights came from
        model, found = shape.build(model_dir, progress)
        self.model: nn.Module | None = model  # None: released
        # what new weights may come as: the startup checkpoint's dtypes or the served one
        # (None with --allow-weight-cast: any floating dtype, cast to the served one)
        self.dtypes = None if cast else found | {shape.info.dtype}

    def candidate(self, model_dir: str) -> tuple[nn.Module | None, str]:
        """The model with the weights of `model_dir`, not serving yet; or what is wrong. A
        checkpoint that cannot be read within READ_TIMEOUT (a hung mount) is given up on."""
        done: Future[tuple[nn.Module, frozenset[torch.dtype]]] = Future()

        def build() -> None:
            try:
                done.set_result(self.shape.build(model_dir, dtypes=self.dtypes))
            except BaseException as exc:
                done.set_exception(exc)

        threading.Thread(target=build, name="checkpoint-read", daemon=True).start()
        try:
            return done.result(timeout=READ_TIMEOUT)[0], ""
        except TimeoutError:
            return None, f"reading {model_dir} took over {READ_TIMEOUT:g} s (a hung mount?)"
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
            check_regular_files(path)
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
                (name, check_tensor(self.model, name, shape, dtype, self.dtypes))
                for name, dtype, shape in specs
            ]
            check_disjoint([(name, slot.dest) for name, slot in slots if slot is not None])
        except CheckpointError as exc:
            return str(exc)
        return ""

    def check_values(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> str:
        """`check` these tensors, and that every value is finite."""
        error = self.check([(name, t.dtype, tuple(t.shape)) for name, t in tensors])
        try:
            for name, tensor in [] if error else tensors:
                check_finite(name, tensor)
        except CheckpointError as exc:
            return str(exc)
        return error

    def install(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
        """Copy named tensors over the served weights (some or all of them). Returns "" or
        what is wrong, and then nothing changed."""
        if self.model is None:
            return RELEASED
        try:
            install_tensors(self.model, tensors, self.dtypes)
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
