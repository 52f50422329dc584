"""Paged attention over a flattened batch: the torch reference path (CPU, and any device).

The KV cache of one layer is a tensor [2, kv_heads, num_blocks, block_size, head_dim]: K and V,
each head's blocks contiguous, so gathering a sequence's keys for one head is a row copy
(`index_select` on a [kv_heads * num_blocks, block_size * head_dim] view), five times faster than
advanced indexing, and yields [kv_heads, tokens, head_dim] matrices that feed a batched matmul
without a transpose. Token `pos` of a sequence lives at `block_table[pos // block_size]`, offset
`pos % block_size`.

A step's batch is flattened to T tokens. Sequences with a single query token (decodes, and the
last token of a fully cached prompt) come first and are computed together; the rest (prefill
chunks) attend one sequence at a time.
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
    gather_rows: torch.Tensor | None  # [kv_heads * blocks] cache rows; None: no cached context
    mask: torch.Tensor | None  # [num_queries, context_len]; None when causal from position 0


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step layout, built once by the model runner and read by every layer."""

    slot_mapping: torch.Tensor  # [T] flat slot (block * block_size + offset) of each token
    num_decodes: int  # rows [0, num_decodes) are single-query sequences
    decode_rows: torch.Tensor  # [num_decodes * kv_heads * max_blocks] cache rows, (b, h, m)
    decode_bias: torch.Tensor  # [num_decodes, 1, 1, max_blocks * block_size]: 0 or -inf
    prefills: list[PrefillSlice]


def gather_rows(block_tables: torch.Tensor, num_kv_heads: int, num_blocks: int) -> torch.Tensor:
    """Cache rows of `block_tables` [..., m] for every head: shape [..., kv_heads, m], flat."""
    heads = torch.arange(num_kv_heads, device=block_tables.device) * num_blocks
    return (block_tables.unsqueeze(-2) + heads[:, None]).flatten()


def store_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Write this step's keys and values [T, kv_heads, head_dim] into their cache slots."""
    kv_heads, head_dim = k.shape[1], k.shape[2]
    kv_cache[0].view(kv_heads, -1, head_dim).index_copy_(1, slots, k.transpose(0, 1))
    kv_cache[1].view(kv_heads, -1, head_dim).index_copy_(1, slots, v.transpose(0, 1))


def paged_attention(
    q: torch.Tensor,  # [T, heads, head_dim]
    k: torch.Tensor,  # [T, kv_heads, head_dim]
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, heads, head_dim]
    store_kv(kv_cache, k, v, meta.slot_mapping)
    if not meta.prefills:  # a pure decode step: no copy into a fresh output
        return _decode(q, kv_cache, meta, scale)
    out = torch.empty_like(q)
    if meta.num_decodes:
        out[: meta.num_decodes] = _decode(q[: meta.num_decodes], kv_cache, meta, scale)
    for p in meta.prefills:
        rows = slice(p.start, p.start + p.num_queries)
        if p.gather_rows is None:  # the whole context is this chunk: attend to it directly
            out[rows] = _attend(
                q[rows], k[rows].transpose(0, 1), v[rows].transpose(0, 1), None, scale
            )
        else:
            keys, values = _gather(kv_cache, p.gather_rows, p.context_len)
            out[rows] = _attend(q[rows], keys, values, p.mask, scale)
    return out


def _gather(
    kv_cache: torch.Tensor, rows: torch.Tensor, context_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's keys and values, [kv_heads, context_len, head_dim] each."""
    kv_heads, _, block_size, head_dim = kv_cache.shape[1:]
    shape = (kv_heads, -1, head_dim)
    keys = kv_cache[0].view(-1, block_size * head_dim).index_select(0, rows).view(shape)
    values = kv_cache[1].view(-1, block_size * head_dim).index_select(0, rows).view(shape)
    return keys[:, :context_len], values[:, :context_len]


def _decode(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    b, heads, head_dim = q.shape
    kv_heads, _, block_size, _ = kv_cache.shape[1:]
    shape = (b, kv_heads, -1, head_dim)  # [B, kv_heads, max_blocks * block_size, D]
    flat = (-1, block_size * head_dim)
    keys = kv_cache[0].view(flat).index_select(0, meta.decode_rows).view(shape)
    values = kv_cache[1].view(flat).index_select(0, meta.decode_rows).view(shape)
    grouped = q.view(b, kv_heads, heads // kv_heads, head_dim)  # query heads share a kv head
    scores = torch.matmul(grouped, keys.transpose(-1, -2)).float() * scale + meta.decode_bias
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    return torch.matmul(probs, values).view(b, heads, head_dim)


def _attend(
    q: torch.Tensor,  # [n, heads, D]
    k: torch.Tensor,  # [kv_heads, ctx, D]
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k,
        v,
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
