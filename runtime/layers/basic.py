"""Small building blocks shared by the Llama-family models."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from runtime.kernels.quant_formats import QuantFormat
from runtime.kernels.select import Kernels, StreamedLinear
from runtime.layers.quantized import QUANT_ROWS, QuantKernels, empty_blocks, quantized_linear

log = logging.getLogger(__name__)


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 exactly as Hugging Face does; with the CPU
    kernels, one pass that rounds where torch's ops round."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, kernels: Kernels | None = None) -> torch.Tensor:
        if self._fused(x, kernels):
            assert kernels is not None
            return kernels.rms_norm(x, self.weight, self.eps)
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return self.weight * normed.to(x.dtype)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor, kernels: Kernels | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): the residual stream's next value and its norm.
        The kernels update `residual` in place; the torch path leaves it alone."""
        if self._fused(x, kernels) and residual.is_contiguous():
            assert kernels is not None
            return kernels.rms_norm(x, self.weight, self.eps, residual), residual
        residual = residual + x
        return self.forward(residual), residual

    def _fused(self, x: torch.Tensor, kernels: Kernels | None) -> bool:
        return (
            kernels is not None
            and x.dim() == 2
            and x.is_contiguous()
            and x.dtype == self.weight.dtype
        )


# at most this many rows (a decode step's) go to the streamed kernel in float32; beyond, BLAS
# runs near the machine's peak. bfloat16 rows all go to it where nothing is packed for oneDNN:
# torch's own bfloat16 GEMM on plain AVX2 ran 4-6x slower than the kernel at every size.
STREAMED_ROWS = 32
# where a weight is packed for oneDNN, only this many rows still stream: beyond, the packed
# GEMM is faster (AMD EPYC with AVX-512 and AVX512-BF16, 2 threads, SmolLM2's 120 layer
# matrices from memory; float32: 1 row 13.2 ms streamed against 19.0 packed, 4 rows 15.8
# against 14.6, 32 rows 47.6 against 40.6, and 224 GFLOP/s for a 512-row prefill where MKL's
# sgemm ran 182-206; bfloat16: 1 row 9.5 against 10.7, 2 rows 9.0 against 11.0, 4 rows 11.1
# against 8.6)
PACKED_STREAMED_ROWS = 2


KIND_STREAMED, KIND_PANELS, KIND_BLOCKS, KIND_REPACKED = 0, 1, 2, 3  # cpu_decode.cpp's Kind


class LinearSpec(NamedTuple):
    """A linear as cpu_decode.cpp's LinearSpec describes it, and the rows it may take."""

    kind: int
    format: int  # the GGUF block type's code (KIND_BLOCKS)
    weight: int  # address
    bias: int  # address, 0: none
    n: int
    k: int
    max_rows: int


class PanelKernels(Protocol):
    """What runtime/kernels/cpu_matmul.py offers for weights packed into panels."""

    @property
    def panel_dtypes(self) -> frozenset[torch.dtype]: ...

    def pack_panels(self, weight: torch.Tensor) -> torch.Tensor: ...

    def panel_linear(
        self, x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None = None
    ) -> torch.Tensor: ...


class Linear(nn.Linear):
    """nn.Linear that, on CPU, hands a decode step's few rows to a kernel that streams the
    weight once (BLAS copies it into its own layout on every call), and can hand its weight
    to oneDNN pre-packed, once (as torch.compile's CPU backend does): bf16 GEMMs of our sizes
    run 15-45% faster that way, with identical results, and float32 ones 10-50% faster than
    MKL's sgemm, which packs the weight again on every call (results differ from it in the
    last bits, as two BLAS libraries' do). Or its weight is kept as GGUF blocks (`quantize_`),
    which runtime/layers/quantized.py multiplies (a decode step's rows from a repacked copy
    of them, where the kernels repack the format). Where the CPU kernels have panels for the
    weight's dtype (bfloat16: AVX512-BF16 without AMX; float32: AVX-512), it is packed into
    cpu_panels.cpp's panels instead of for oneDNN: they multiply every number of rows of a
    step as fast or faster (bfloat16 1.6x at one row, 1.25x at 32; float32 1.5x, 1.1x).
    """

    packed: torch.Tensor | None = None
    panels: torch.Tensor | None = None  # the weight packed for `panel_kernels`
    panel_kernels: PanelKernels | None = None
    streamed: StreamedLinear | None = None
    quant: QuantFormat | None = None  # the weight is blocks of this format
    quant_kernels: QuantKernels | None = None
    repacked: torch.Tensor | None = None  # the blocks as quant_kernels.repack_blocks made them

    def quantize_(self, fmt: QuantFormat) -> None:
        """Hold the weight as (empty) blocks of `fmt`, for the loader to fill."""
        self.weight = empty_blocks(self.out_features, self.in_features, fmt, self.weight.device)
        self.quant = fmt

    def pack_for_cpu(
        self,
        streamed: StreamedLinear | None = None,
        batch_hint: int = 32,
        quant_kernels: QuantKernels | None = None,
        float32: bool = True,
        panel_kernels: PanelKernels | None = None,
        repack: bool = True,
    ) -> None:
        """Pack the weight for oneDNN on CPU: bf16 where oneDNN has a bf16 path (AVX-512 or
        AVX-NE-CONVERT, not plain AVX2), float32 if `float32` and with the CPU kernels only
        (without them the layers stay torch's reference path). Where nothing is packed, a
        decode step's rows (bf16: all rows) go to `streamed`; where it is, a step of one or
        two rows does. Blocks go to `quant_kernels`, repacked if `repack` and the kernels
        repack their format; weights of a dtype whose panels `panel_kernels` has go to them
        instead of oneDNN (float32 only if `float32`)."""
        self.packed = self.panels = self.repacked = None
        self.quant_kernels = quant_kernels
        self.panel_kernels = panel_kernels
        if self._panelled(panel_kernels, float32):
            assert panel_kernels is not None
            self.panels = panel_kernels.pack_panels(self.weight.detach())
        elif self.quant is not None and quant_kernels is not None and repack:
            if self._repacks(quant_kernels):
                self.repacked = quant_kernels.repack_blocks(self.weight.detach(), self.quant)
        elif (
            self.quant is None
            and self.weight.device.type == "cpu"
            and self._packs(streamed, float32)
        ):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), batch_hint)
        self.streamed = streamed if self.weight.device.type == "cpu" else None

    def _panelled(self, kernels: PanelKernels | None, float32: bool) -> bool:
        weight = self.weight
        if kernels is None or self.quant is not None or weight.device.type != "cpu":
            return False
        if weight.dtype == torch.float32 and not float32:  # the copies would not fit
            return False
        odd = weight.dtype == torch.bfloat16 and weight.shape[1] % 2  # pairs of k
        return weight.dtype in kernels.panel_dtypes and weight.dim() == 2 and not odd

    def _repacks(self, kernels: QuantKernels) -> bool:
        assert self.quant is not None
        if self.weight.device.type != "cpu" or self.weight.shape[0] % kernels.repacked_rows:
            return False
        return self.quant.name in kernels.repacked_formats

    def _packs(self, streamed: StreamedLinear | None, float32: bool) -> bool:
        if not torch.backends.mkldnn.is_available():
            return False
        if self.weight.dtype == torch.bfloat16:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        return self.weight.dtype == torch.float32 and float32 and streamed is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.bias)

    def product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quant is not None:
            kernels, repacked = self.quant_kernels, self.repacked
            return quantized_linear(x, self.weight, self.quant, bias, kernels, repacked)
        if self.panels is not None and self._fits_panels(x):
            assert self.panel_kernels is not None
            return self.panel_kernels.panel_linear(x, self.panels, self.weight.shape[0], bias)
        if self.streamed is not None and self._streams(x):
            return self.streamed(x, self.weight, bias)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
        return F.linear(x, self.weight, bias)

    def decode_spec(self, dtype: torch.dtype) -> LinearSpec | None:
        """How cpu_decode.cpp multiplies this layer's decode rows of `dtype` exactly as
        `product` would (the same kernel), and up to how many rows; None where `product`
        would hand them to torch."""
        weight, bias = self.weight, self.bias
        if bias is not None and (bias.dtype != dtype or not bias.is_contiguous()):
            return None
        n, k = self.out_features, self.in_features
        address = (weight.data_ptr(), 0 if bias is None else bias.data_ptr())
        if self.quant is not None:
            if self.quant_kernels is None or dtype != torch.float32:
                return None
            if self.repacked is not None:
                repacked = (self.repacked.data_ptr(), address[1])
                return LinearSpec(KIND_REPACKED, self.quant.code, *repacked, n, k, QUANT_ROWS)
            return LinearSpec(KIND_BLOCKS, self.quant.code, *address, n, k, QUANT_ROWS)
        if self.panels is not None and dtype == weight.dtype:
            return LinearSpec(KIND_PANELS, 0, self.panels.data_ptr(), address[1], n, k, 1 << 30)
        if self.streamed is None or weight.dtype != dtype or not weight.is_contiguous():
            return None
        return LinearSpec(KIND_STREAMED, 0, *address, n, k, self._streamed_rows())

    def _fits_panels(self, x: torch.Tensor) -> bool:
        return x.dim() == 2 and x.is_contiguous() and x.dtype == self.weight.dtype

    def _streams(self, x: torch.Tensor) -> bool:
        if x.dim() != 2 or not x.is_contiguous() or x.dtype != self.weight.dtype:
            return False
        return x.shape[0] <= self._streamed_rows()

    def _streamed_rows(self) -> int:
        """Up to how many rows of a step `streamed` takes; beyond, oneDNN or BLAS."""
        if self.packed is not None:  # oneDNN takes all but the smallest steps
            return PACKED_STREAMED_ROWS
        return STREAMED_ROWS if self.weight.dtype == torch.float32 else 1 << 30


def pack_linears_for_cpu(
    model: nn.Module,
    streamed: StreamedLinear | None = None,
    quant_kernels: QuantKernels | None = None,
    panel_kernels: PanelKernels | None = None,
) -> None:
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    float32, repack = float32_copies_fit(linears), repacked_copies_fit(linears)
    for module in linears:
        module.pack_for_cpu(streamed, quant_kernels=quant_kernels, float32=float32,
                            panel_kernels=panel_kernels, repack=repack)  # fmt: skip


def float32_copies_fit(linears: list[Linear]) -> bool:
    """Whether float32 weights may be packed: each packed copy is a second copy of its weight,
    so only while they take at most half the memory the system has available (a 7B model in
    float32 would want 28 GB more). Once packed they stay so, through weight updates: the
    new copies replace the old ones."""
    weights = [m.weight for m in linears if m.quant is None and m.weight.dtype == torch.float32]
    packed = (m for m in linears if m.packed is not None or m.panels is not None)
    if any(m.weight.dtype == torch.float32 for m in packed):
        return True
    why = "float32 weights not packed for oneDNN; prefills run MKL's GEMM instead"
    return copies_fit(weights, why)


def repacked_copies_fit(linears: list[Linear]) -> bool:
    """Whether GGUF blocks may be repacked for decode steps: a second copy of each, as for
    float32 (the file's layout stays for prefills, the embedding and weight updates)."""
    if any(m.repacked is not None for m in linears):
        return True
    why = "GGUF blocks not repacked; decode steps read the file's layout, 2-3x slower"
    return copies_fit([m.weight for m in linears if m.quant is not None], why)


def copies_fit(weights: list[torch.Tensor], why: str) -> bool:
    """Whether copies of `weights` take at most half the memory available; if not, says so."""
    size = sum(w.numel() * w.element_size() for w in weights if w.device.type == "cpu")
    if size <= available_memory() // 2:
        return True
    log.warning("%s: the copies (%.1f GB) would take over half of the memory available",
                why, size / 1e9)  # fmt: skip
    return False


def available_memory() -> int:
    """Bytes the system can still give (MemAvailable), or its free pages where /proc lacks it."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        meminfo = Path("/proc/meminfo").read_text().splitlines()
        line = next(line for line in meminfo if line.startswith("MemAvailable:"))
        return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
