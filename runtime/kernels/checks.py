"""Argument checks shared by the CPU and Triton kernels: both read raw memory, so a layout
or dtype they do not take must be refused before the call, not discovered inside it."""

from __future__ import annotations

from collections.abc import Collection

import torch


class KernelError(RuntimeError):
    """The kernel refused its arguments (an index outside the cache, a bad shape)."""


def check_heads_packed(x: torch.Tensor) -> None:
    """The kernels step over tokens by stride(0) and expect each token's heads packed."""
    if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        raise KernelError(f"heads of one token must be contiguous, strides {x.stride()}")


def check_rows(x: torch.Tensor, kv_cache: torch.Tensor, dtypes: Collection[torch.dtype]) -> None:
    check_heads_packed(x)
    if x.dtype != kv_cache.dtype or kv_cache.dtype not in dtypes:
        raise KernelError(f"dtype {x.dtype} with a {kv_cache.dtype} cache")
    if not kv_cache.is_contiguous():
        raise KernelError("the KV cache must be contiguous")


def check_contiguous(
    *tensors: torch.Tensor, dtypes: Collection[torch.dtype], like: torch.Tensor | None = None
) -> None:
    dtype = (like if like is not None else tensors[0]).dtype
    if dtype not in dtypes:
        raise KernelError(f"expected one dtype of {', '.join(map(str, dtypes))}, got {dtype}")
    for t in tensors:
        if not t.is_contiguous() or t.dtype != dtype or dtype not in dtypes:
            raise KernelError(f"expected contiguous {dtype} tensors, got {t.dtype}")


def check_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor | None,
    dtypes: Collection[torch.dtype],
) -> None:
    """RMSNorm's x [rows, dim], its weight, and the residual x is added to first, if any."""
    check_contiguous(x, weight, *(() if residual is None else (residual,)), dtypes=dtypes)
    if residual is not None and residual.shape != x.shape:
        raise KernelError(f"residual {tuple(residual.shape)} for x {tuple(x.shape)}")


def check_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtypes: Collection[torch.dtype]
) -> None:
    """x [T, heads, dim] with each token's heads packed, and one table row per token."""
    tokens, _, dim = x.shape
    check_heads_packed(x)
    check_contiguous(cos, sin, like=x, dtypes=dtypes)
    if cos.numel() != tokens * dim or sin.numel() != tokens * dim:
        raise KernelError(f"rotary tables of {cos.numel()} values for {tokens} x {dim}")


def check_sampling(logits: torch.Tensor, *params: tuple[torch.Tensor, torch.dtype]) -> None:
    """float32 logits [B, vocab] (rows may be strided) and one (tensor, dtype) per row
    parameter, each a contiguous [B] of that dtype."""
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1:
        raise KernelError(f"expected float32 [B, vocab] logits, got {logits.dtype}")
    rows = logits.shape[0]
    for tensor, dtype in params:
        if tensor.shape != (rows,) or tensor.dtype != dtype or not tensor.is_contiguous():
            raise KernelError(f"expected [{rows}] {dtype}, got {tensor.shape} {tensor.dtype}")


def sampling_params(
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    uniforms: torch.Tensor,
) -> tuple[tuple[torch.Tensor, torch.dtype], ...]:
    """The sampling kernels' row parameters with the dtypes both kernel sets read."""
    return (
        (temperature, torch.float32),
        (top_k, torch.int64),
        (top_p, torch.float32),
        (min_p, torch.float32),
        (uniforms, torch.float64),
    )
