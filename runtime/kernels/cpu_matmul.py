"""The CPU kernels' matmuls: a decode step's rows against float32 or bfloat16 weights
(cpu_linear.cpp), rows against weights packed into panels (cpu_panels.cpp), and rows against
GGUF's quantized blocks as the file has them (cpu_quant.cpp) or repacked (cpu_repacked.cpp).
"""

from __future__ import annotations

import torch

from runtime.kernels.checks import KernelError, check_contiguous
from runtime.kernels.cpu_library import DTYPES, LINEAR_TILE, PANEL, QUANT_ISAS, CpuLibrary
from runtime.kernels.quant_formats import BLOCK, FORMATS, QuantFormat

PANEL_DTYPES = {1: torch.bfloat16, 2: torch.float32}  # panel_isa's bits


class CpuMatmuls(CpuLibrary):
    """The matmul kernels' torch-shaped wrappers."""

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [rows, k] @ weight [n, k]^T + bias, each weight read once (a decode step; in
        bfloat16 on CPUs where oneDNN has no bf16 path, every step)."""
        check_contiguous(x, weight, *(() if bias is None else (bias,)), dtypes=DTYPES)
        rows, k = x.shape
        n = weight.shape[0]
        if weight.shape[1] != k or (bias is not None and bias.shape != (n,)):
            raise KernelError(f"x {tuple(x.shape)}, weight {tuple(weight.shape)}")
        out = x.new_empty((rows, n))
        threads = torch.get_num_threads()
        floats = streamed_scratch_floats(rows, n, k, threads) if x.dtype == torch.bfloat16 else 0
        scratch = torch.empty(floats, dtype=torch.float32)
        self._call(
            "skinny_linear",
            DTYPES[x.dtype],
            out.data_ptr(),
            x.data_ptr(),
            weight.data_ptr(),
            None if bias is None else bias.data_ptr(),
            rows,
            n,
            k,
            scratch.data_ptr(),
            threads,
        )
        return out

    @property
    def panel_dtypes(self) -> frozenset[torch.dtype]:
        """The dtypes whose linears this build's panels take (cpu_panels.cpp's panel_isa):
        bfloat16 with AVX512-BF16 and no AMX (with AMX, oneDNN's path stays), float32 with
        AVX-512 (with AVX2 only, oneDNN's GEMM stays ahead)."""
        kinds = int(self._functions["panel_isa"]())
        return frozenset(dtype for bit, dtype in PANEL_DTYPES.items() if kinds & bit)

    def pack_panels(self, weight: torch.Tensor) -> torch.Tensor:
        """A weight [n, k] (bfloat16: k even) packed into the panels `panel_linear` reads.
        float32 packs on any CPU; bfloat16 where the build has AVX512-BF16."""
        check_contiguous(weight, dtypes=DTYPES)
        n, k = weight.shape
        panels = weight.new_empty(-(-n // PANEL) * PANEL * k)
        threads = torch.get_num_threads()
        dtype = DTYPES[weight.dtype]
        self._call("panel_pack", dtype, panels.data_ptr(), weight.data_ptr(), n, k, threads)
        return panels

    def panel_linear(
        self, x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [rows, k] @ W^T + bias, W [n, k] packed by `pack_panels`, all of x's dtype."""
        check_contiguous(x, panels, *(() if bias is None else (bias,)), dtypes=DTYPES)
        rows, k = x.shape
        expected = -(-n // PANEL) * PANEL * k
        if panels.numel() != expected or (bias is not None and bias.shape != (n,)):
            raise KernelError(f"x {tuple(x.shape)} against {n} panelled outputs")
        out = x.new_empty((rows, n))
        self._call(
            "panel_linear", DTYPES[x.dtype], out.data_ptr(), x.data_ptr(), panels.data_ptr(),
            None if bias is None else bias.data_ptr(), rows, n, k, torch.get_num_threads(),
        )  # fmt: skip
        return out

    def quant_linear(
        self,
        x: torch.Tensor,  # [rows, k] float32
        blocks: torch.Tensor,  # [n, fmt.row_bytes(k)] uint8: a matrix [n, k] in format `fmt`
        fmt: QuantFormat,
        bias: torch.Tensor | None = None,  # [n] float32
    ) -> torch.Tensor:  # [rows, n] float32
        """x @ W^T + bias with W read as its blocks, x quantized to int8 blocks on the way in
        (llama.cpp's scheme: cpu_quant.cpp), each weight read once."""
        rows, k = _check_blocks(x, blocks, fmt, bias)
        n = blocks.shape[0]
        out = x.new_empty((rows, n))
        scratch = self._scratch(quant_scratch_bytes(rows, k))
        self._call(
            "quant_linear",
            fmt.code,
            out.data_ptr(),
            x.data_ptr(),
            blocks.data_ptr(),
            None if bias is None else bias.data_ptr(),
            rows,
            n,
            k,
            scratch,
            torch.get_num_threads(),
        )
        return out

    @property
    def quant_isa(self) -> str:
        """What this build's quant_linear computes with: "AVX-512 VNNI", "AVX-512", "AVX2" or
        "plain loops" (RUNTIME_KERNEL_ISA=avx2 builds the AVX2 ones on an AVX-512 CPU)."""
        return QUANT_ISAS[int(self._functions["quant_isa"]())]

    @property
    def repacked_formats(self) -> frozenset[str]:
        """The block formats `repack_blocks` takes: Q4_0 and Q4_1, and Q8_0 where the build's
        int8 products are exact past 127 (VNNI, or the plain loops)."""
        bits = int(self._functions["repacked_formats"]())
        return frozenset(name for name, fmt in FORMATS.items() if bits >> fmt.code & 1)

    @property
    def repacked_rows(self) -> int:
        """Weight rows a repacked group interleaves (a vector's lanes): N must be a multiple."""
        return int(self._functions["repacked_rows"]())

    def repack_blocks(self, blocks: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
        """Blocks [n, row_bytes] of format `fmt` as `repacked_linear` reads them: the same
        bytes, groups of `repacked_rows` rows interleaved (cpu_repacked.cpp)."""
        n, k = _check_rows_of_blocks(blocks, fmt)
        out = torch.empty_like(blocks)
        threads = torch.get_num_threads()
        self._call("quant_repack", fmt.code, out.data_ptr(), blocks.data_ptr(), n, k, threads)
        return out

    def repacked_linear(
        self,
        x: torch.Tensor,  # [rows, k] float32
        repacked: torch.Tensor,  # `repack_blocks` of a matrix [n, k] in format `fmt`
        fmt: QuantFormat,
        bias: torch.Tensor | None = None,  # [n] float32
    ) -> torch.Tensor:  # [rows, n] float32
        """As `quant_linear`, from the repacked blocks: each weight read once, kLanes rows a
        vector (where a row of blocks in the file's order costs ~3x the instructions)."""
        rows, k = _check_blocks(x, repacked, fmt, bias)
        n = repacked.shape[0]
        out = x.new_empty((rows, n))
        scratch = self._scratch(quant_scratch_bytes(rows, k))
        self._call(
            "repacked_linear", fmt.code, out.data_ptr(), x.data_ptr(), repacked.data_ptr(),
            None if bias is None else bias.data_ptr(), rows, n, k, scratch,
            torch.get_num_threads(),
        )  # fmt: skip
        return out

    def dequantize(self, blocks: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
        """The float32 matrix [n, k] that blocks [n, row_bytes] of format `fmt` stand for."""
        n, k = _check_rows_of_blocks(blocks, fmt)
        out = torch.empty((n, k), dtype=torch.float32)
        threads = torch.get_num_threads()
        self._call("quant_dequantize", fmt.code, out.data_ptr(), blocks.data_ptr(), n, k, threads)
        return out


def _check_rows_of_blocks(blocks: torch.Tensor, fmt: QuantFormat) -> tuple[int, int]:
    """(n, k) of blocks [n, row_bytes] of format `fmt` standing for a matrix [n, k]."""
    if blocks.dtype != torch.uint8 or not blocks.is_contiguous() or blocks.dim() != 2:
        raise KernelError(f"expected contiguous uint8 [n, row_bytes], got {blocks.dtype}")
    n, row_bytes = blocks.shape
    if row_bytes % fmt.block_bytes:
        raise KernelError(f"rows of {row_bytes} bytes are no whole {fmt.name} blocks")
    return n, row_bytes // fmt.block_bytes * BLOCK


def _check_blocks(
    x: torch.Tensor, blocks: torch.Tensor, fmt: QuantFormat, bias: torch.Tensor | None
) -> tuple[int, int]:
    """(rows, k) of float32 x [rows, k] against blocks [n, row_bytes] of a [n, k] matrix."""
    check_contiguous(x, *(() if bias is None else (bias,)), dtypes=(torch.float32,))
    if blocks.dtype != torch.uint8 or not blocks.is_contiguous() or x.dim() != 2:
        raise KernelError(f"x {x.dtype} {tuple(x.shape)}, blocks {blocks.dtype}")
    rows, k = x.shape
    if k % BLOCK or blocks.shape[1:] != (fmt.row_bytes(k),):
        raise KernelError(f"x {tuple(x.shape)} against {fmt.name} blocks {tuple(blocks.shape)}")
    if bias is not None and bias.shape != (blocks.shape[0],):
        raise KernelError(f"bias {tuple(bias.shape)} for {blocks.shape[0]} outputs")
    return rows, k


def streamed_scratch_floats(rows: int, n: int, k: int, threads: int) -> int:
    """What cpu_linear.cpp widens bfloat16 into: x, the results, a weight tile per thread."""
    return rows * (k + n) + threads * LINEAR_TILE * k


def quant_scratch_bytes(rows: int, k: int) -> int:
    """x quantized for cpu_quant.cpp: int8 values and two float vectors per step of 64
    (more than cpu_repacked.cpp's int8 values and two floats per block of 32)."""
    return rows * -(-k // (2 * BLOCK)) * 192
