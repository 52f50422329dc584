"""Which kernels a worker runs: the compiled CPU ones (cpu.py), the Triton ones (gpu.py), or
none (the torch reference path, runtime/layers/). Both kernel sets have the same methods;
the model code sees them only through `Kernels`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import torch

from runtime.kernels.checks import KernelError
from runtime.kernels.cpu import DTYPES as CPU_DTYPES
from runtime.kernels.cpu import CpuKernels, load_cpu_kernels

log = logging.getLogger(__name__)
BACKENDS = ("auto", "cpp", "triton", "torch")
# y = x W^T + b by a kernel that reads W once (runtime/kernels/cpu_linear.cpp): (x, W, b)
StreamedLinear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


class Kernels(Protocol):
    name: str  # "cpp" or "triton", as the worker reports it
    extends: bool  # True: an ExtendKernels, whose `extend` computes prefill chunks
    samples: bool  # True: a SamplingKernels, whose `sample` draws the sampled rows' tokens

    def store_kv(self, kv_cache: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor) -> None: ...

    def decode(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor: ...

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor: ...

    def rotary_(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> None: ...

    def greedy(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class ExtendKernels(Kernels, Protocol):
    """Kernels that also compute prefill chunks, reading their context from the cache."""

    def extend(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        q_starts: torch.Tensor,
        q_lens: torch.Tensor,
        context_lens: torch.Tensor,
        max_queries: int,
        scale: float,
    ) -> torch.Tensor: ...


class SamplingKernels(Kernels, Protocol):
    """Kernels that also sample: temperature, top-k, top-p and min-p, from one uniform per
    row, as runtime/worker/sampler.py's `choose` does."""

    def sample(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        min_p: torch.Tensor,
        uniforms: torch.Tensor,
    ) -> torch.Tensor: ...


def select_kernels(backend: str, device: torch.device, dtype: torch.dtype) -> Kernels | None:
    """The kernels `backend` asks for ("auto", "cpp", "triton" or "torch"); None: the torch
    path. "auto": cpp on CPU (float32 or bfloat16, with a C++ compiler), triton on CUDA."""
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend {backend!r} is not one of {', '.join(BACKENDS)}")
    if backend == "torch":
        return None
    if backend == "triton" or (backend == "auto" and device.type == "cuda"):
        return _triton(device, explicit=backend == "triton")
    applies = device.type == "cpu" and dtype in CPU_DTYPES
    if backend == "cpp" and not applies:
        raise ValueError(
            f"attention_backend 'cpp' runs on CPU in float32 or bfloat16, not {device} {dtype}"
        )
    if not applies:
        return None
    try:
        return load_cpu_kernels()
    except KernelError as exc:
        if backend == "cpp":
            raise
        log.warning("the CPU attention kernels are unavailable, using torch's: %s", exc)
        return None


def streamed_linear(kernels: Kernels | None) -> StreamedLinear | None:
    """The kernel that computes a decode step's linears by streaming each weight once (CPU
    kernels only: on a GPU, cuBLAS does that)."""
    return kernels.linear if isinstance(kernels, CpuKernels) else None


def quant_kernels(kernels: Kernels | None) -> CpuKernels | None:
    """The kernels that multiply GGUF blocks (runtime/layers/quantized.py): the CPU ones; else
    the layers dequantize and multiply in torch."""
    return kernels if isinstance(kernels, CpuKernels) else None


def _triton(device: torch.device, explicit: bool) -> Kernels | None:
    try:
        import triton  # noqa: F401  (an optional dependency in effect: it may fail to load)

        from runtime.kernels.gpu import TritonKernels, interpreting
    except ImportError as exc:
        if explicit:
            raise ValueError(f"attention_backend 'triton' needs Triton: {exc}") from exc
        log.warning("Triton is unavailable, using torch's attention: %s", exc)
        return None
    if device.type != "cuda" and not interpreting():
        raise ValueError(
            f"attention_backend 'triton' runs on CUDA, not {device} (on the CPU only in "
            "Triton's interpreter, TRITON_INTERPRET=1, which is for tests)"
        )
    return TritonKernels()
