"""Weights kept as GGUF blocks (runtime/kernels/quant_formats.py): how a linear layer and the
embedding compute with them. A layer holds its blocks as a uint8 parameter [N, row_bytes] and
their format in `quant`; runtime/worker/quantization.py decides which layers do.

A decode step's few rows go to the int8 kernels: cpu_repacked.cpp where the layer holds a
repacked copy of its blocks (`Linear.repacked`, rows interleaved so that a vector's lanes are
rows: 2-3x faster), cpu_quant.cpp on the file's layout otherwise; more rows (a prefill chunk)
are multiplied by BLAS against the dequantized float32 matrix, which is faster there: the
kernel scales every block of every product in float, BLAS runs FMAs at full rate (measured
on an AVX-512 Xeon, one thread, SmolLM2's four matrices of a layer: the kernel ahead up to 32
rows, 2x behind at 128). Without the CPU kernels (`--attention-backend torch`) every product
is the dequantized matrix's, in float32: the reference the kernels are tested against.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from runtime.kernels.quant_formats import QuantFormat, dequantize

QUANT_ROWS = 32  # rows up to which the int8 kernel computes; beyond, dequantize then BLAS
# Weights dequantized at a time for BLAS: a layer's matrix at once, an LM head of 49k rows
# (113 MB in float32) in slices.
DEQUANTIZE_CHUNK = 1 << 22


class QuantKernels(Protocol):
    """What runtime/kernels/cpu.py's CpuKernels offers for quantized weights."""

    def quant_linear(
        self,
        x: torch.Tensor,
        blocks: torch.Tensor,
        fmt: QuantFormat,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def dequantize(self, blocks: torch.Tensor, fmt: QuantFormat) -> torch.Tensor: ...

    @property
    def repacked_formats(self) -> frozenset[str]: ...

    @property
    def repacked_rows(self) -> int: ...

    def repack_blocks(self, blocks: torch.Tensor, fmt: QuantFormat) -> torch.Tensor: ...

    def repacked_linear(
        self,
        x: torch.Tensor,
        repacked: torch.Tensor,
        fmt: QuantFormat,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


def quantized_linear(
    x: torch.Tensor,  # [rows, k], float32 or bfloat16
    blocks: torch.Tensor,  # [n, row_bytes] uint8
    fmt: QuantFormat,
    bias: torch.Tensor | None,
    kernels: QuantKernels | None,
    repacked: torch.Tensor | None = None,  # the blocks as `kernels.repack_blocks` made them
) -> torch.Tensor:  # [rows, n] in x's dtype, computed in float32
    if (
        kernels is not None
        and x.dim() == 2
        and x.shape[0] <= QUANT_ROWS
        and x.dtype == torch.float32
    ):
        # a decode step's rows as the model hands them, straight to the kernel: the general
        # path's reshapes and casts cost ~5 us a call, a third of a small matrix's product
        b = None if bias is None else bias.float()
        return _decode_product(x.contiguous(), blocks, fmt, b, kernels, repacked)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).float().contiguous()
    b = None if bias is None else bias.float()
    if kernels is not None and x2.shape[0] <= QUANT_ROWS:
        y = _decode_product(x2, blocks, fmt, b, kernels, repacked)
    else:
        y = _dequantized_product(x2, blocks, fmt, b, kernels)
    return y.to(x.dtype).reshape(*shape[:-1], blocks.shape[0])


def _decode_product(
    x: torch.Tensor,
    blocks: torch.Tensor,
    fmt: QuantFormat,
    bias: torch.Tensor | None,
    kernels: QuantKernels,
    repacked: torch.Tensor | None,
) -> torch.Tensor:
    if repacked is not None:
        return kernels.repacked_linear(x, repacked, fmt, bias)
    return kernels.quant_linear(x, blocks, fmt, bias)


def _dequantized_product(
    x: torch.Tensor,
    blocks: torch.Tensor,
    fmt: QuantFormat,
    bias: torch.Tensor | None,
    kernels: QuantKernels | None,
) -> torch.Tensor:
    n, k = blocks.shape[0], x.shape[1]
    chunk = max(1, DEQUANTIZE_CHUNK // k)
    if n <= chunk:
        return F.linear(x, float_rows(blocks, fmt, kernels), bias)
    out = x.new_empty((x.shape[0], n))
    for start in range(0, n, chunk):
        part = slice(start, min(n, start + chunk))
        b = None if bias is None else bias[part]
        out[:, part] = F.linear(x, float_rows(blocks[part], fmt, kernels), b)
    return out


def float_rows(
    blocks: torch.Tensor, fmt: QuantFormat, kernels: QuantKernels | None
) -> torch.Tensor:
    """Rows of blocks as float32: by the kernel, or in torch (the reference path)."""
    if kernels is not None:
        return kernels.dequantize(blocks.contiguous(), fmt)
    return dequantize(blocks, fmt.name)


def empty_blocks(rows: int, k: int, fmt: QuantFormat, device: torch.device) -> torch.nn.Parameter:
    """The parameter that holds a [rows, k] matrix as blocks, filled by the loader."""
    blocks = torch.empty(fmt.packed_shape((rows, k)), dtype=torch.uint8, device=device)
    return torch.nn.Parameter(blocks, requires_grad=False)
