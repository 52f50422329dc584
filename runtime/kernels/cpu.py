"""The CPU kernels: paged attention (cpu_attention.cpp), the fused small ops between the
matmuls (cpu_fused.cpp), a decode step's matmuls (cpu_linear.cpp), matmuls with GGUF's
quantized blocks (cpu_quant.cpp) and sampling (cpu_sampling.cpp), compiled once per machine
with g++, cached across restarts, called through ctypes.

No torch headers are involved, so a build takes seconds rather than the minute a
`torch.utils.cpp_extension` build takes; cpu_build.py builds and caches it.
"""

from __future__ import annotations

import ctypes
import subprocess
import threading
from functools import cache
from pathlib import Path
from typing import Any

import torch

from runtime.kernels.checks import (
    KernelError,
    check_contiguous,
    check_norm,
    check_rotary,
    check_rows,
    check_sampling,
    sampling_params,
)
from runtime.kernels.cpu_build import built_library, find_compiler
from runtime.kernels.quant_formats import BLOCK, QuantFormat

DTYPES = {torch.float32: 0, torch.bfloat16: 1}
LINEAR_TILE = 4  # cpu_linear.cpp's kTileN: weight rows widened at once, per thread
# Each C entry point's arguments, as the .cpp files declare them: i int, q int64, f float,
# p pointer. Every one returns an int: 0, or a code for `_raise_for`.
SIGNATURES = {
    "paged_decode": "i p p q p p q p q q q q q q f i",
    "paged_extend": "i p p q q p p q p p p q q q q q q f i",
    "paged_store_kv": "i p p q p q q q q",
    "fused_add_rms_norm": "i p p p p q q f i",
    "fused_silu_and_mul": "i p p q q i",
    "fused_rotary": "i p q q q q p p i",
    "greedy_pick": "p q q p p i",
    "sample_pick": "p q q q p p p p p p i",
    "skinny_linear": "i p p p p q q q p i",
    "quant_linear": "i p p p p q q q p i",
    "quant_dequantize": "i p p q q i",
    "quant_isa": "",
}
QUANT_ISAS = {0: "plain loops", 1: "AVX2", 2: "AVX-512", 3: "AVX-512 VNNI"}
_CTYPES = {"i": ctypes.c_int, "q": ctypes.c_int64, "f": ctypes.c_float, "p": ctypes.c_void_p}


class CpuKernels:
    """ctypes handles on the compiled kernels, with torch-shaped wrappers."""

    name = "cpp"
    extends = True  # prefill chunks read their context from the cache (`extend`)
    samples = True  # sampled rows go through `sample`, not a sort

    def __init__(self, library: Path) -> None:
        lib = ctypes.CDLL(str(library))
        self._per_thread = threading.local()  # scratch buffers (`_scratch`)
        self._functions: dict[str, Any] = {}
        for name, codes in SIGNATURES.items():
            function = getattr(lib, name)
            function.argtypes = [_CTYPES[code] for code in codes.split()]
            self._functions[name] = function
        self.library = library

    def _call(self, name: str, *args: Any) -> None:
        """Run one kernel; under torch.profiler it shows as `runtime::<name>` (otherwise a
        check of ~0.1 us, where a record_function would cost microseconds every call)."""
        function = self._functions[name]
        if torch._C._autograd._profiler_enabled():
            with torch.profiler.record_function(f"runtime::{name}"):
                _raise_for(function(*args))
        else:
            _raise_for(function(*args))

    def greedy(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(argmax [B] int64, its log-probability [B]) of float32 logits [B, vocab]."""
        if logits.dtype != torch.float32 or not logits.is_contiguous() or logits.dim() != 2:
            raise KernelError(f"expected contiguous float32 [B, vocab] logits, got {logits.dtype}")
        rows, vocab = logits.shape
        tokens = torch.empty(rows, dtype=torch.int64)
        logprobs = torch.empty(rows, dtype=torch.float32)
        self._call(
            "greedy_pick",
            logits.data_ptr(),
            rows,
            vocab,
            tokens.data_ptr(),
            logprobs.data_ptr(),
            torch.get_num_threads(),
        )
        return tokens, logprobs

    def sample(
        self,
        logits: torch.Tensor,  # [B, vocab] float32
        temperature: torch.Tensor,  # [B] float32; 0: greedy
        top_k: torch.Tensor,  # [B] int64; 0: all
        top_p: torch.Tensor,  # [B] float32
        min_p: torch.Tensor,  # [B] float32
        uniforms: torch.Tensor,  # [B] float64 in (0, 1)
    ) -> torch.Tensor:  # [B] int64: the torch sampler's tokens, without its sort
        params = sampling_params(temperature, top_k, top_p, min_p, uniforms)
        check_sampling(logits, *params)
        rows, vocab = logits.shape
        tokens = torch.empty(rows, dtype=torch.int64)
        self._call(
            "sample_pick",
            logits.data_ptr(),
            logits.stride(0),
            rows,
            vocab,
            *(tensor.data_ptr() for tensor, _ in params),
            tokens.data_ptr(),
            torch.get_num_threads(),
        )
        return tokens

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
        # bfloat16 is widened to float32 in scratch: x, the results, a weight tile per thread
        floats = rows * (k + n) + threads * LINEAR_TILE * k if x.dtype == torch.bfloat16 else 0
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
        # x quantized: int8 values and two float vectors per step of 64 (cpu_quant.cpp)
        scratch = self._scratch(rows * -(-k // (2 * BLOCK)) * 192)
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

    def _scratch(self, size: int) -> int:
        """The address of a buffer of at least `size` bytes (64-byte aligned, as torch
        allocates), this thread's own, kept from call to call."""
        buffer = getattr(self._per_thread, "scratch", None)
        if buffer is None or buffer.numel() < size:
            buffer = self._per_thread.scratch = torch.empty(size, dtype=torch.uint8)
        return buffer.data_ptr()

    @property
    def quant_isa(self) -> str:
        """What this build's quant_linear computes with: "AVX-512 VNNI", "AVX-512", "AVX2" or
        "plain loops" (RUNTIME_KERNEL_ISA=avx2 builds the AVX2 ones on an AVX-512 CPU)."""
        return QUANT_ISAS[int(self._functions["quant_isa"]())]

    def dequantize(self, blocks: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
        """The float32 matrix [n, k] that blocks [n, row_bytes] of format `fmt` stand for."""
        if blocks.dtype != torch.uint8 or not blocks.is_contiguous() or blocks.dim() != 2:
            raise KernelError(f"expected contiguous uint8 [n, row_bytes], got {blocks.dtype}")
        n, row_bytes = blocks.shape
        if row_bytes % fmt.block_bytes:
            raise KernelError(f"rows of {row_bytes} bytes are no whole {fmt.name} blocks")
        k = row_bytes // fmt.block_bytes * BLOCK
        out = torch.empty((n, k), dtype=torch.float32)
        threads = torch.get_num_threads()
        self._call("quant_dequantize", fmt.code, out.data_ptr(), blocks.data_ptr(), n, k, threads)
        return out

    def rms_norm(
        self,
        x: torch.Tensor,  # [rows, dim]
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,  # [rows, dim]: residual += x, then its norm
    ) -> torch.Tensor:
        check_norm(x, weight, residual, DTYPES)
        out = torch.empty_like(x)
        rows, dim = x.shape
        self._call(
            "fused_add_rms_norm",
            DTYPES[x.dtype],
            out.data_ptr(),
            None if residual is None else residual.data_ptr(),
            x.data_ptr(),
            weight.data_ptr(),
            rows,
            dim,
            eps,
            torch.get_num_threads(),
        )
        return out

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of x = [rows, 2 * inter] (gate, then up): [rows, inter]."""
        check_contiguous(x, dtypes=DTYPES)
        rows, width = x.shape
        out = x.new_empty((rows, width // 2))
        self._call(
            "fused_silu_and_mul",
            DTYPES[x.dtype],
            out.data_ptr(),
            x.data_ptr(),
            rows,
            width // 2,
            torch.get_num_threads(),
        )
        return out

    def rotary_(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> None:
        """Rotate x [T, heads, dim] in place (a view whose tokens may be strided)."""
        tokens, heads, dim = x.shape
        check_rotary(x, cos, sin_signed, DTYPES)
        self._call(
            "fused_rotary",
            DTYPES[x.dtype],
            x.data_ptr(),
            x.stride(0),
            tokens,
            heads,
            dim,
            cos.data_ptr(),
            sin_signed.data_ptr(),
            torch.get_num_threads(),
        )

    def store_kv(self, kv_cache: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor) -> None:
        """kv: [T, 2 * kv_heads, head_dim], rows of one token may be strided; slots: [T]."""
        tokens, heads, dim = kv.shape
        check_rows(kv, kv_cache, DTYPES)
        _check_index(slots)
        self._call(
            "paged_store_kv",
            DTYPES[kv_cache.dtype],
            kv_cache.data_ptr(),
            kv.data_ptr(),
            kv.stride(0),
            slots.data_ptr(),
            tokens,
            heads // 2,
            kv_cache.shape[2] * kv_cache.shape[3],
            dim,
        )

    def decode(
        self,
        q: torch.Tensor,  # [B, heads, head_dim], rows of one token may be strided
        kv_cache: torch.Tensor,  # [2, kv_heads, num_blocks, block_size, head_dim]
        block_tables: torch.Tensor,  # [B, width] int64
        context_lens: torch.Tensor,  # [B] int64
        scale: float,
    ) -> torch.Tensor:
        batch, heads, dim = q.shape
        check_rows(q, kv_cache, DTYPES)
        _check_index(block_tables)
        _check_index(context_lens)
        if context_lens.shape != (batch,) or block_tables.shape[0] != batch:
            raise KernelError(
                f"{batch} queries, {block_tables.shape[0]} tables, {context_lens.shape} lengths"
            )
        out = q.new_empty((batch, heads, dim))
        self._call(
            "paged_decode", DTYPES[kv_cache.dtype], out.data_ptr(), q.data_ptr(), q.stride(0),
            kv_cache.data_ptr(), block_tables.data_ptr(), block_tables.shape[1],
            context_lens.data_ptr(), batch, *_attention_shape(q, kv_cache, scale),
        )  # fmt: skip
        return out

    def extend(
        self,
        q: torch.Tensor,  # [T, heads, head_dim], rows of one token may be strided
        kv_cache: torch.Tensor,  # this step's keys and values already stored
        block_tables: torch.Tensor,  # [S, width] int64
        q_starts: torch.Tensor,  # [S] int64: each chunk's first row of q
        q_lens: torch.Tensor,  # [S] int64
        context_lens: torch.Tensor,  # [S] int64: tokens attended to, the chunk's included
        max_queries: int,  # (how the Triton kernel sizes its grid; unused here)
        scale: float,
    ) -> torch.Tensor:  # [T, heads, head_dim]; rows of no chunk are left unwritten
        tokens, heads, dim = q.shape
        check_rows(q, kv_cache, DTYPES)
        for index in (block_tables, q_starts, q_lens, context_lens):
            _check_index(index)
        chunks = block_tables.shape[0]
        if not q_starts.shape == q_lens.shape == context_lens.shape == (chunks,):
            raise KernelError(
                f"{chunks} tables, {q_starts.shape} starts, {q_lens.shape} query lengths, "
                f"{context_lens.shape} context lengths"
            )
        out = q.new_empty((tokens, heads, dim))
        self._call(
            "paged_extend", DTYPES[kv_cache.dtype], out.data_ptr(), q.data_ptr(), q.stride(0),
            tokens, kv_cache.data_ptr(), block_tables.data_ptr(), block_tables.shape[1],
            q_starts.data_ptr(), q_lens.data_ptr(), context_lens.data_ptr(), chunks,
            *_attention_shape(q, kv_cache, scale),
        )  # fmt: skip
        return out


def _attention_shape(q: torch.Tensor, kv_cache: torch.Tensor, scale: float) -> tuple[Any, ...]:
    """The attention kernels' last arguments: (heads, kv_heads, num_blocks, block_size,
    head_dim, scale, threads)."""
    _, kv_heads, num_blocks, block_size, dim = kv_cache.shape
    # threads: torch's setting (OpenMP's own is per OS thread)
    return q.shape[1], kv_heads, num_blocks, block_size, dim, scale, torch.get_num_threads()


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


def _check_index(x: torch.Tensor) -> None:
    if x.dtype != torch.int64 or not x.is_contiguous():
        raise KernelError(f"indices must be contiguous int64, not {x.dtype}")


def _raise_for(code: int) -> None:
    if code:
        reasons = {1: "heads do not group"}
        reasons |= {2: "a context length (or a prefill chunk) is outside its block table (or q)"}
        reasons |= {3: "a block id is outside the cache", 4: "a slot is outside the cache"}
        reasons |= {10: "K is not a multiple of 32", 11: "no kernel for this block format"}
        raise KernelError(reasons.get(code, f"unsupported dtype (code {code})"))


@cache
def load_cpu_kernels() -> CpuKernels:
    """The kernels, built if needed. Raises KernelError if they cannot be built."""
    compiler = find_compiler()
    if compiler is None:
        raise KernelError("no C++ compiler (g++ or c++ on PATH, or $CXX)")
    try:
        with built_library(compiler) as library:
            return CpuKernels(library)
    except subprocess.CalledProcessError as exc:
        raise KernelError(f"{compiler} failed on the CPU kernels:\n{exc.stderr}") from exc
    except OSError as exc:  # a library that does not load
        raise KernelError(f"cannot build or load the CPU kernels: {exc}") from exc
