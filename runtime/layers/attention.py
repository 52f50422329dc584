"""Paged attention over a flattened batch: the torch reference path (CPU, and any device).

The KV cache of one layer is a tensor [2, num_blocks, block_size, num_kv_heads, head_dim]. A
token's KV lives in slot `block_table[pos // block_size] * block_size + pos % block_size`.

A step's batch is flattened to T tokens. Sequences with a single query token (decodes, and the
last token of a fully cached prompt) come first and are computed together by gathering their
blocks; the rest (prefill chunks) attend one sequence at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillSlice:
    start: int  # row of this sequence's first query in the flattened batch
    num_queries: int
    context_len: int  # tokens attended to, the queries themselves included
    block_table: torch.Tensor  # [ceil(context_len / block_size)]
    mask: torch.Tensor | None  # [num_queries, context_len]; None when causal from position 0


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step layout, built once by the model runner and read by every layer."""

    slot_mapping: torch.Tensor  # [T]
    num_decodes: int  # rows [0, num_decodes) are single-query sequences
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks], padded with block 0
    decode_mask: torch.Tensor  # [num_decodes, 1, 1, max_blocks * block_size], True = attend
    prefills: list[PrefillSlice]


def store_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Write this step's keys and values [T, kv_heads, head_dim] into their cache slots."""
    kv_heads, head_dim = k.shape[1], k.shape[2]
    kv_cache[0].view(-1, kv_heads, head_dim).index_copy_(0, slots, k)
    kv_cache[1].view(-1, kv_heads, head_dim).index_copy_(0, slots, v)


def paged_attention(
    q: torch.Tensor,  # [T, heads, head_dim]
    k: torch.Tensor,  # [T, kv_heads, head_dim]
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, heads, head_dim]
    store_kv(kv_cache, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    if meta.num_decodes:
        out[: meta.num_decodes] = _decode(q[: meta.num_decodes], kv_cache, meta, scale)
    for p in meta.prefills:
        rows = slice(p.start, p.start + p.num_queries)
        if p.mask is None:  # the whole context is this chunk: attend to it directly
            out[rows] = _attend(q[rows], k[rows], v[rows], None, scale)
        else:
            keys, values = _gather(kv_cache, p.block_table, p.context_len)
            out[rows] = _attend(q[rows], keys, values, p.mask, scale)
    return out


def _decode(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    b, _, head_dim = q.shape
    kv_heads = kv_cache.shape[3]
    keys = kv_cache[0][meta.decode_block_tables].view(b, -1, kv_heads, head_dim)  # [B, L, kvh, D]
    values = kv_cache[1][meta.decode_block_tables].view(b, -1, kv_heads, head_dim)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # [B, heads, 1, D]
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=meta.decode_mask,
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(2)


def _gather(
    kv_cache: torch.Tensor, block_table: torch.Tensor, context_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    keys = kv_cache[0][block_table].view(-1, kv_heads, head_dim)[:context_len]
    values = kv_cache[1][block_table].view(-1, kv_heads, head_dim)[:context_len]
    return keys, values


def _attend(
    q: torch.Tensor,  # [n, heads, D]
    k: torch.Tensor,  # [ctx, kv_heads, D]
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(0, 1)


def causal_mask(num_queries: int, context_len: int, device: torch.device) -> torch.Tensor:
    """Query i sits at position context_len - num_queries + i and sees keys up to there."""
    offset = context_len - num_queries
    return torch.ones(num_queries, context_len, dtype=torch.bool, device=device).tril(offset)
