"""Paged attention over a flattened batch: the torch reference path (any device), and the
kernels (runtime/kernels/: compiled for the CPU, Triton for CUDA) for what they cover: storing
keys and values, and the single-query rows, read from the cache in place.

The KV cache of one layer is a tensor [2, kv_heads, num_blocks, block_size, head_dim]: K then
V, each head's blocks contiguous. Viewed as rows of one block of one head ([2 * kv_heads *
num_blocks, block_size * head_dim]), gathering a sequence's keys and values is one row copy
(`index_select`, five times faster than advanced indexing here) that lands as [kv_heads, tokens,
head_dim] matrices, ready for a batched matmul without a transpose. Token `pos` of a sequence
lives in block `block_table[pos // block_size]` at offset `pos % block_size`.

Kernels that extend (the Triton ones and the compiled CPU ones) compute every prefill chunk of
a step in one call, reading the context, this step's tokens included, from the cache in place.

The projections arrive fused, as `heads` [T, heads + 2 * kv_heads, head_dim] (q, then k, then
v heads, rotary already applied), so one `index_copy_` stores a step's keys and values.

A step's batch is flattened to T tokens. Sequences with a single query token (decodes, and the
last token of a fully cached prompt) come first and are computed together; the rest (prefill
chunks) attend all in one `extend` call, or on the torch path one sequence at a time (torch's
fused SDPA).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F

from runtime.kernels.select import ExtendKernels, Kernels


@dataclass(slots=True)
class PrefillSlice:
    start: int  # row of this sequence's first query in the flattened batch
    num_queries: int
    context_len: int  # tokens attended to, the queries themselves included
    gather_rows: torch.Tensor | None  # cache rows of its blocks (K and V); None: no cached context
    mask: torch.Tensor | None  # [num_queries, context_len] additive; None: causal from 0


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step layout, built once by the model runner and read by every layer."""

    slot_mapping: torch.Tensor  # [T] flat slot (block * block_size + offset) of each token
    num_decodes: int  # rows [0, num_decodes) are single-query sequences
    prefills: list[PrefillSlice]
    kernels: Kernels | None = None  # None: the torch path
    # the torch path's decode layout
    decode_rows: torch.Tensor | None = None  # cache rows (K and V) of their blocks, padded
    decode_bias: torch.Tensor | None = None  # [decodes * kv_heads, 1, width * block_size]: 0/-inf
    # the kernels' decode layout
    decode_tables: torch.Tensor | None = None  # [decodes, width] block ids, padded
    decode_lens: torch.Tensor | None = None  # [decodes] tokens each attends to
    extend: ExtendLayout | None = None  # kernels that extend: the prefills, read in place


@dataclass(slots=True)
class ExtendLayout:
    """The prefill slices as kernels that read their context from the cache take them."""

    tables: torch.Tensor  # [prefills, width] block ids, padded
    q_starts: torch.Tensor  # [prefills] first row of each in the flattened batch
    q_lens: torch.Tensor  # [prefills] queries
    context_lens: torch.Tensor  # [prefills] tokens attended to, the queries included
    max_queries: int


def gather_rows(block_tables: torch.Tensor, num_kv_heads: int, num_blocks: int) -> torch.Tensor:
    """Cache rows of `block_tables` [..., m] for K and V of every head: [2, ..., kv_heads, m]."""
    device = block_tables.device
    offsets = torch.arange(2 * num_kv_heads, device=device).view(2, num_kv_heads) * num_blocks
    shape = (2,) + (1,) * (block_tables.dim() - 1) + (num_kv_heads, 1)
    return (block_tables.unsqueeze(-2).unsqueeze(0) + offsets.view(shape)).flatten()


def store_kv(kv_cache: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor) -> None:
    """Write this step's keys and values (kv: [T, 2 * kv_heads, head_dim]) into their slots."""
    head_dim = kv.shape[-1]
    kv_cache.view(kv.shape[1], -1, head_dim).index_copy_(1, slots, kv.transpose(0, 1))


def paged_attention(
    heads: torch.Tensor,  # [T, num_heads + 2 * kv_heads, head_dim]
    num_heads: int,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    if meta.kernels is None:
        store_kv(kv_cache, heads[:, num_heads:], meta.slot_mapping)
    else:
        meta.kernels.store_kv(kv_cache, heads[:, num_heads:], meta.slot_mapping)
    q = heads[:, :num_heads]
    if not meta.prefills:  # a pure decode step: no copy into a fresh output
        return _decode(q, kv_cache, meta, scale)
    if meta.extend is not None:  # the prefill rows in one call, then the decode rows
        layout, kernels = meta.extend, cast(ExtendKernels, meta.kernels)
        out = kernels.extend(
            q, kv_cache, layout.tables, layout.q_starts, layout.q_lens, layout.context_lens,
            layout.max_queries, scale,
        )  # fmt: skip
        if meta.num_decodes:
            out[: meta.num_decodes] = _decode(q[: meta.num_decodes], kv_cache, meta, scale)
        return out
    out = q.new_empty(q.shape)
    if meta.num_decodes:
        out[: meta.num_decodes] = _decode(q[: meta.num_decodes], kv_cache, meta, scale)
    kv_heads = kv_cache.shape[1]
    for p in meta.prefills:
        rows = slice(p.start, p.start + p.num_queries)
        if p.gather_rows is None:  # the whole context is this chunk: attend to it directly
            chunk = heads[rows, num_heads:].transpose(0, 1)  # [2 * kv_heads, n, D]
            out[rows] = _attend(q[rows], chunk[:kv_heads], chunk[kv_heads:], None, scale)
        else:
            keys, values = _gather(kv_cache, p.gather_rows, 1, p.context_len)
            out[rows] = _attend(q[rows], keys[0], values[0], p.mask, scale)
    return out


def _gather(
    kv_cache: torch.Tensor, rows: torch.Tensor, batch: int, context_len: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of `batch` sequences, [batch, kv_heads, tokens, head_dim] each."""
    kv_heads, _, block_size, head_dim = kv_cache.shape[1:]
    flat = kv_cache.view(-1, block_size * head_dim).index_select(0, rows)
    keys, values = flat.view(2, batch, kv_heads, -1, head_dim)
    if context_len is not None:
        keys, values = keys[:, :, :context_len], values[:, :, :context_len]
    return keys, values


def _decode(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    if meta.kernels is not None:
        assert meta.decode_tables is not None and meta.decode_lens is not None
        return meta.kernels.decode(q, kv_cache, meta.decode_tables, meta.decode_lens, scale)
    assert meta.decode_rows is not None and meta.decode_bias is not None
    b, heads, head_dim = q.shape
    kv_heads = kv_cache.shape[1]
    keys, values = _gather(kv_cache, meta.decode_rows, b)  # [B, kv_heads, L, D]
    grouped = q.reshape(b * kv_heads, heads // kv_heads, head_dim)  # query heads share a kv head
    keys, values = (
        keys.reshape(b * kv_heads, -1, head_dim),
        values.reshape(b * kv_heads, -1, head_dim),
    )
    scores = torch.baddbmm(meta.decode_bias, grouped, keys.transpose(1, 2), alpha=scale)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
    return torch.bmm(probs, values).view(b, heads, head_dim)


def _attend(
    q: torch.Tensor,  # [n, heads, D]
    k: torch.Tensor,  # [kv_heads, ctx, D]
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    # With a batch dimension torch takes its fused (flash) CPU kernel; 3-D inputs fall back
    # to the unfused math path, measured 2x (float32) to 4x (bfloat16) slower on prefill.
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k[None],
        v[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def causal_mask(
    num_queries: int, context_len: int, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """Query i sits at position context_len - num_queries + i and sees keys up to there.
    Additive (0 / -inf, in the model's dtype): SDPA would convert a boolean mask again in
    every layer (measured: an `aten::where` per layer, ~3% of a chunked prefill)."""
    hidden = torch.full((num_queries, context_len), -torch.inf, dtype=dtype, device=device)
    return hidden.triu_(context_len - num_queries + 1)  # keys past the query's position
