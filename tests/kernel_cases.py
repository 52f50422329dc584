"""Random paged-attention cases and a float64 reference, shared by the CPU and GPU kernel
tests."""

from __future__ import annotations

import torch


def reference(q, cache, tables, lens, scale):  # type: ignore[no-untyped-def]
    """q [B, H, D]; cache [2, KV, blocks, bs, D]: attention in float64, one sequence at a time."""
    batch, heads, dim = q.shape
    kv_heads, block_size = cache.shape[1], cache.shape[3]
    out = torch.empty(batch, heads, dim, dtype=torch.float64)
    for b in range(batch):
        n = int(lens[b])
        blocks = tables[b, : -(-n // block_size)]
        k, v = (cache[i][:, blocks].reshape(kv_heads, -1, dim)[:, :n].double() for i in (0, 1))
        grouped = q[b].double().view(kv_heads, heads // kv_heads, dim)
        probs = torch.softmax(grouped @ k.transpose(1, 2) * scale, dim=-1)
        out[b] = (probs @ v).reshape(heads, dim)
    return out


def random_case(
    batch: int,
    heads: int,
    kv_heads: int,
    dim: int,
    block_size: int,
    longest: int,
    dtype: torch.dtype,
    seed: int = 0,
):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    num_blocks = batch * -(-longest // block_size) + 3
    cache = torch.randn(2, kv_heads, num_blocks, block_size, dim, generator=gen).to(dtype)
    width = -(-longest // block_size)
    order = torch.randperm(num_blocks, generator=gen)  # each sequence owns scattered blocks
    tables = order[: batch * width].view(batch, width).clone()
    lens = torch.randint(1, longest + 1, (batch,), generator=gen)
    lens[0] = longest
    # q inside a fused [B, heads + 2 * kv_heads, D] projection, as the model passes it
    fused = torch.randn(batch, heads + 2 * kv_heads, dim, generator=gen).to(dtype)
    return fused[:, :heads], cache, tables, lens


def poison_past_the_end(cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor) -> None:
    """NaN in the slots of each sequence's last block past its length: a kernel that reads
    them (even with a zero weight) returns NaN."""
    block_size = cache.shape[3]
    for table, n in zip(tables.tolist(), lens.tolist(), strict=True):
        cache[:, :, table[(n - 1) // block_size], (n - 1) % block_size + 1 :] = torch.nan
