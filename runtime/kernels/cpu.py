"""The CPU kernels: paged attention (cpu_attention.cpp), the fused small ops between the
matmuls (cpu_fused.cpp), the matmuls (cpu_matmul.py wraps cpu_linear.cpp, cpu_panels.cpp and
cpu_quant.cpp) and sampling (cpu_sampling.cpp), compiled once per machine with g++, cached
across restarts, called through ctypes (cpu_library.py).

No torch headers are involved, so a build takes seconds rather than the minute a
`torch.utils.cpp_extension` build takes; cpu_build.py builds and caches it.
"""

from __future__ import annotations

import subprocess
from functools import cache
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
from runtime.kernels.cpu_library import DTYPES
from runtime.kernels.cpu_matmul import CpuMatmuls

__all__ = ["DTYPES", "CpuKernels", "KernelError", "load_cpu_kernels"]


class CpuKernels(CpuMatmuls):
    """The compiled kernels with torch-shaped wrappers."""

    name = "cpp"
    extends = True  # prefill chunks read their context from the cache (`extend`)
    samples = True  # sampled rows go through `sample`, not a sort

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

    def decode_layers(self, *args: Any) -> None:
        """A decode step's decoder layers in one call: runtime/layers/decode_layers.py
        describes them and passes cpu_decode.cpp's arguments."""
        self._call("decode_layers", *args)


def _attention_shape(q: torch.Tensor, kv_cache: torch.Tensor, scale: float) -> tuple[Any, ...]:
    """The attention kernels' last arguments: (heads, kv_heads, num_blocks, block_size,
    head_dim, scale, threads)."""
    _, kv_heads, num_blocks, block_size, dim = kv_cache.shape
    # threads: torch's setting (OpenMP's own is per OS thread)
    return q.shape[1], kv_heads, num_blocks, block_size, dim, scale, torch.get_num_threads()


def _check_index(x: torch.Tensor) -> None:
    if x.dtype != torch.int64 or not x.is_contiguous():
        raise KernelError(f"indices must be contiguous int64, not {x.dtype}")


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
