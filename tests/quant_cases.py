"""GGUF blocks' kernels against a dequantize-then-matmul reference: the cases and checks that
tests/test_quant_kernels.py (the file's layout) and tests/test_quant_repacked.py share."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.kernels.cpu import CpuKernels
from runtime.kernels.quant_formats import BLOCK, FORMATS, dequantize, quantize

NAMES = list(FORMATS)
SHAPES = [  # rows, n, k, bias
    (1, 1, 32, False),  # one block, one output
    (1, 7, 64, True),  # a decode row, a partial tile of weight rows
    (3, 13, 96, False),  # an odd number of blocks: AVX-512's last step half empty
    (2, 9, 224, True),  # 7 blocks
    (32, 64, 576, True),  # a full decode batch, SmolLM2's hidden size
    (5, 3, 1536, False),  # SmolLM2's intermediate size
]


def weights(n: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    w[0, :BLOCK] = 0.0  # an all-zero block: scale 0
    if k > BLOCK:
        w[-1, BLOCK : 2 * BLOCK] = 0.25  # a constant block
    return w


def int8_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel quantizes it on the way in: int8 per block of 32, a float32 scale
    amax / 127, rounded to nearest even; returned as the float64 values that stands for."""
    blocks = x.reshape(x.shape[0], -1, BLOCK)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(blocks * inverse)
    return (q.double() * d.double()).reshape(x.shape)


def reference(
    x: torch.Tensor, blocks: torch.Tensor, name: str, bias: torch.Tensor | None
) -> torch.Tensor:
    w = dequantize(blocks, name).double()
    return F.linear(int8_rows(x), w, None if bias is None else bias.double())


def check_kernel(kernels: CpuKernels, name: str, rows: int, n: int, k: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=gen)
    blocks = quantize(weights(n, k, seed=n + k), name)
    b = torch.randn(n, generator=gen) if bias else None
    out = kernels.quant_linear(x, blocks, FORMATS[name], b)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    # x quantized as the kernel does: only float32 rounding apart
    torch.testing.assert_close(out.double(), reference(x, blocks, name, b), atol=1e-4, rtol=1e-4)
    # and against the float product, what the quantization of x costs: under 2% of its norm
    w = dequantize(blocks, name).double()
    exact = F.linear(x.double(), w, None if b is None else b.double())
    assert (out.double() - exact).norm() <= 0.02 * exact.norm()
    assert torch.equal(kernels.dequantize(blocks, FORMATS[name]), dequantize(blocks, name))


# n a multiple of 16, the rows a repacked group interleaves with AVX-512 (8 with AVX2)
REPACKED_SHAPES = [  # rows, n, k, bias
    (1, 16, 32, False),  # one group, one block
    (1, 48, 64, True),  # a decode row
    (3, 32, 96, False),  # an odd number of blocks
    (5, 64, 576, True),  # a tile of rows and one more
    (32, 16, 1536, False),  # a full decode batch, SmolLM2's intermediate size
]


def check_repacked(kernels: CpuKernels, name: str, rows: int, n: int, k: int, bias: bool) -> None:
    """cpu_repacked.cpp against the reference, and against cpu_quant.cpp on the same blocks."""
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=gen)
    blocks = quantize(weights(n, k, seed=n + k), name)
    b = torch.randn(n, generator=gen) if bias else None
    fmt = FORMATS[name]
    repacked = kernels.repack_blocks(blocks, fmt)
    assert (repacked.shape == blocks.shape and not torch.equal(repacked, blocks)) or n == 1
    out = kernels.repacked_linear(x, repacked, fmt, b)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference(x, blocks, name, b), atol=1e-4, rtol=1e-4)
    # the same int8 sums, added in another order
    torch.testing.assert_close(out, kernels.quant_linear(x, blocks, fmt, b), atol=1e-4, rtol=1e-4)


def check_all_repacked(kernels: CpuKernels, shapes: list[tuple[int, int, int, bool]]) -> None:
    for name in kernels.repacked_formats:
        for rows, n, k, bias in shapes:
            if n % kernels.repacked_rows == 0:
                check_repacked(kernels, name, rows, n, k, bias)
