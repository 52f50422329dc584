"""The Triton kernels (gpu_attention.py, gpu_fused.py) behind the same methods as the CPU
kernels, plus `extend` (prefill over cached prefixes), for `--device cuda`.

Without a GPU they run in Triton's interpreter (TRITON_INTERPRET=1, set before triton is
imported): slowly, on the CPU, which is how CI proves them against the torch reference.
"""

from __future__ import annotations

import torch
import triton

from runtime.kernels.checks import (
    KernelError,
    check_contiguous,
    check_norm,
    check_rotary,
    check_rows,
    check_sampling,
    sampling_params,
)
from runtime.kernels.gpu_attention import (
    combine_splits_kernel,
    decode_kernel,
    extend_kernel,
    store_kv_kernel,
)
from runtime.kernels.gpu_fused import add_rms_norm_kernel, rotary_kernel, silu_and_mul_kernel
from runtime.kernels.gpu_sampling import sample_kernel

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK_N = 32  # cached tokens per iteration of the attention loops
# queries per program of extend: 64 fills the tensor cores on long chunks; 16 (tl.dot's
# smallest tile) wastes less on short ones, such as a few new tokens after a cached prefix
BLOCK_M_LONG, BLOCK_M_SHORT = 64, 16
SPLIT_MIN_TOKENS = 256  # decode splits a context only into parts at least this long
MAX_SPLITS = 16


def interpreting() -> bool:
    return bool(triton.knobs.runtime.interpret)


def decode_splits(max_context: int) -> int:
    """How many parts decode splits each context into, for contexts of up to `max_context`
    tokens: enough that a long one keeps the GPU busy at small batch, at most one per
    SPLIT_MIN_TOKENS. Each sequence divides its own length by it (decode_kernel)."""
    return max(1, min(MAX_SPLITS, max_context // SPLIT_MIN_TOKENS))


class TritonKernels:
    """Same interface as runtime.kernels.cpu.CpuKernels, on CUDA tensors (or CPU tensors
    under the interpreter)."""

    name = "triton"
    extends = True  # prefill chunks go through `extend`, not torch's SDPA
    samples = True  # sampled rows go through `sample`, not a sort

    def store_kv(self, kv_cache: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor) -> None:
        """kv: [T, 2 * kv_heads, head_dim], tokens may be strided; slots: [T] (-1: skip)."""
        tokens, planes, dim = kv.shape
        check_rows(kv, kv_cache, DTYPES)
        plane_slots = kv_cache.shape[2] * kv_cache.shape[3]
        store_kv_kernel[(tokens,)](
            kv_cache, kv, slots, kv.stride(0), planes, plane_slots, dim,
            PLANES=_pow2(planes), DIM=_pow2(dim),
        )  # fmt: skip

    def decode(
        self,
        q: torch.Tensor,  # [B, heads, head_dim], tokens may be strided
        kv_cache: torch.Tensor,  # [2, kv_heads, num_blocks, block_size, head_dim]
        block_tables: torch.Tensor,  # [B, width] int64
        context_lens: torch.Tensor,  # [B] int64 (0: a padding row, output 0)
        scale: float,
    ) -> torch.Tensor:
        batch, heads, dim = q.shape
        check_rows(q, kv_cache, DTYPES)
        _, kv_heads, num_blocks, block_size, _ = kv_cache.shape
        if heads % kv_heads:
            raise KernelError(f"{heads} query heads do not group over {kv_heads} kv heads")
        group, width = heads // kv_heads, block_tables.shape[1]
        splits = decode_splits(width * block_size)
        partial_out = q.new_empty((batch, heads, splits, _dot_dim(dim)), dtype=torch.float32)
        partial_lse = q.new_empty((batch, heads, splits), dtype=torch.float32)
        decode_kernel[(batch, kv_heads, splits)](
            partial_out, partial_lse, q, kv_cache, block_tables, context_lens,
            q.stride(0), width, kv_heads, num_blocks * block_size, block_size, dim, scale,
            GROUP=group, GROUP_PAD=max(16, _pow2(group)), DIM=_dot_dim(dim), BLOCK_N=BLOCK_N,
            DOT_FP32=_dot_fp32(q.dtype),
        )  # fmt: skip
        out = q.new_empty((batch, heads, dim))
        combine_splits_kernel[(batch * heads,)](
            out, partial_out, partial_lse, splits, dim, SPLITS=_pow2(splits), DIM=_dot_dim(dim)
        )
        return out

    def extend(
        self,
        q: torch.Tensor,  # [T, heads, head_dim], tokens may be strided
        kv_cache: torch.Tensor,  # this step's keys and values already stored
        block_tables: torch.Tensor,  # [S, width] int64
        q_starts: torch.Tensor,  # [S] int64
        q_lens: torch.Tensor,  # [S] int64
        context_lens: torch.Tensor,  # [S] int64
        max_queries: int,  # the longest q_len: how many query blocks to launch
        scale: float,
    ) -> torch.Tensor:  # [T, heads, head_dim]; rows of no sequence are left unwritten
        tokens, heads, dim = q.shape
        check_rows(q, kv_cache, DTYPES)
        _, kv_heads, num_blocks, block_size, _ = kv_cache.shape
        out = q.new_empty((tokens, heads, dim))
        block_m = BLOCK_M_LONG if max_queries >= BLOCK_M_LONG else BLOCK_M_SHORT
        grid = (block_tables.shape[0], heads, -(-max_queries // block_m))
        extend_kernel[grid](
            out, q, kv_cache, block_tables, q_starts, q_lens, context_lens,
            q.stride(0), block_tables.shape[1], kv_heads, num_blocks * block_size,
            block_size, dim, scale,
            GROUP=heads // kv_heads, DIM=_dot_dim(dim), BLOCK_M=block_m, BLOCK_N=BLOCK_N,
            DOT_FP32=_dot_fp32(q.dtype),
        )  # fmt: skip
        return out

    def rms_norm(
        self,
        x: torch.Tensor,  # [rows, dim]
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,  # [rows, dim]: residual += x, then its norm
    ) -> torch.Tensor:
        check_norm(x, weight, residual, DTYPES)
        rows, dim = x.shape
        out = torch.empty_like(x)
        add_rms_norm_kernel[(rows,)](
            out, x if residual is None else residual, x, weight, dim, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=_pow2(dim),
        )  # fmt: skip
        return out

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of x = [rows, 2 * inter] (gate, then up): [rows, inter]."""
        check_contiguous(x, dtypes=DTYPES)
        rows, width = x.shape
        out = x.new_empty((rows, width // 2))
        silu_and_mul_kernel[(rows,)](out, x, width // 2, BLOCK=min(1024, _pow2(width // 2)))
        return out

    def rotary_(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> None:
        """Rotate x [T, heads, dim] in place (a view whose tokens may be strided)."""
        tokens, heads, dim = x.shape
        check_rotary(x, cos, sin_signed, DTYPES)
        rotary_kernel[(tokens,)](
            x, cos, sin_signed, x.stride(0), heads, dim, HEADS=_pow2(heads), HALF=_pow2(dim // 2)
        )

    def sample(
        self,
        logits: torch.Tensor,  # [B, vocab] float32
        temperature: torch.Tensor,  # [B] float32; 0: greedy
        top_k: torch.Tensor,  # [B] int64; 0: all
        top_p: torch.Tensor,  # [B] float32
        min_p: torch.Tensor,  # [B] float32
        uniforms: torch.Tensor,  # [B] float64 in (0, 1)
    ) -> torch.Tensor:  # [B] int64: the torch sampler's tokens (runtime/kernels/gpu_sampling.py)
        check_sampling(logits, *sampling_params(temperature, top_k, top_p, min_p, uniforms))
        rows, vocab = logits.shape
        tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
        sample_kernel[(rows,)](
            tokens, logits, temperature, top_k, top_p, min_p, uniforms, vocab, logits.stride(0),
            BLOCK=min(4096, _pow2(vocab)),
        )  # fmt: skip
        return tokens

    def greedy(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(argmax [B], its log-probability [B]) of float32 logits [B, vocab]."""
        tokens = logits.argmax(dim=-1)
        best = logits.gather(-1, tokens[:, None]).squeeze(-1)
        return tokens, best - torch.logsumexp(logits, dim=-1)


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(n, 1))


def _dot_dim(head_dim: int) -> int:
    """head_dim padded for tl.dot, which takes no dimension under 16."""
    return max(16, _pow2(head_dim))


def _dot_fp32(dtype: torch.dtype) -> bool:
    # the interpreter multiplies bfloat16 as raw bits (triton-lang/triton#11584)
    return dtype == torch.float32 or interpreting()
