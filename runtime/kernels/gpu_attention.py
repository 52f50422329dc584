"""Triton kernels of paged attention: storing a step's keys and values into their slots,
single-query (decode) attention split over the context, and prefill / extend attention over a
flattened batch whose earlier tokens are already cached.

The cache layout is runtime/layers/attention.py's: [2, kv_heads, num_blocks, block_size, dim],
K then V, so token `pos` of a sequence lies in plane `head` (K) or `kv_heads + head` (V), block
`table[pos // block_size]`, row `pos % block_size`. Any block size works: addresses are
computed per token.

Scores, the softmax and the accumulators are float32. With DOT_FP32 the products are too
(float32 caches, and Triton's interpreter, which cannot multiply bfloat16); otherwise q·k and
p·v run in the cache's dtype on the tensor cores, with p (the exponentials against the running
maximum, before normalizing) rounded to that dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl

from runtime.kernels.gpu_fused import round_to


@triton.jit
def store_kv_kernel(
    cache,  # [2 * kv_heads planes, num_blocks * block_size slots, dim]
    kv,  # [tokens, 2 * kv_heads, dim], heads of a token packed, tokens `token_stride` apart
    slots,  # [tokens] int64; negative: a padding row, stored nowhere
    token_stride,
    planes,
    plane_slots,
    dim,
    PLANES: tl.constexpr,
    DIM: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots + token)
    if slot >= 0:
        plane = tl.arange(0, PLANES)[:, None].to(tl.int64)
        col = tl.arange(0, DIM)[None, :]
        inside = (plane < planes) & (col < dim)
        rows = tl.load(kv + token * token_stride + plane * dim + col, mask=inside)
        tl.store(cache + (plane * plane_slots + slot) * dim + col, rows, mask=inside)


@triton.jit
def _cached_rows(cache, table, pos, inside, plane, plane_slots, block_size, dim, DIM: tl.constexpr):
    """[len(pos), DIM] rows of one plane at the token positions `pos` of one sequence."""
    block = tl.load(table + pos // block_size, mask=inside, other=0).to(tl.int64)
    slot = block * block_size + pos % block_size
    col = tl.arange(0, DIM)[None, :]
    address = cache + (plane.to(tl.int64) * plane_slots + slot[:, None]) * dim + col
    return tl.load(address, mask=inside[:, None] & (col < dim), other=0.0)


@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr):
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _attend_keys(q_rows, cache, table, pos, inside, visible, kv_head, kv_heads, plane_slots,
                 block_size, dim, scale, top, total, acc, DIM: tl.constexpr,
                 DOT_FP32: tl.constexpr):  # fmt: skip
    """One step of the online softmax: the queries `q_rows` against the cached keys and
    values at `pos` (loaded where `inside`), scored where `visible`. Returns the running
    maximum, the running sum of exponentials and the unnormalized output, updated."""
    k = _cached_rows(cache, table, pos, inside, kv_head, plane_slots, block_size, dim, DIM)
    scores = _dot(q_rows, tl.trans(k), DOT_FP32) * scale
    scores = tl.where(visible, scores, float("-inf"))
    new_top = tl.maximum(top, tl.max(scores, axis=1))
    p = tl.exp(scores - new_top[:, None])
    rescale = tl.exp(top - new_top)
    v = _cached_rows(
        cache, table, pos, inside, kv_heads + kv_head, plane_slots, block_size, dim, DIM
    )
    acc = acc * rescale[:, None] + _dot(p.to(v.dtype), v, DOT_FP32)
    return new_top, total * rescale + tl.sum(p, axis=1), acc


@triton.jit
def decode_kernel(
    partial_out,  # [batch, heads, splits, DIM] float32: each split's normalized output
    partial_lse,  # [batch, heads, splits] float32: each split's log-sum-exp of scores
    q,  # [batch, heads, dim], tokens `q_stride` apart
    cache,
    tables,  # [batch, width] int64
    lens,  # [batch] int64: tokens each sequence attends to (0: a padding row)
    q_stride,
    width,
    kv_heads,
    plane_slots,
    block_size,
    dim,
    scale,
    GROUP: tl.constexpr,  # query heads per kv head
    GROUP_PAD: tl.constexpr,  # GROUP rounded up for tl.dot (at least 16)
    DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """One (sequence, kv head, split): its group of query heads over its share of the
    context, with an online softmax."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    split = tl.program_id(2)
    splits = tl.num_programs(2)
    length = tl.load(lens + seq)
    # each sequence splits its own context: a short one in a batch (or a CUDA graph) sized
    # for long ones still spreads over every split
    split_tokens = tl.cdiv(tl.cdiv(length, splits), BLOCK_N) * BLOCK_N
    start = split * split_tokens
    end = tl.minimum(length, start + split_tokens)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM)
    heads = head * GROUP + g
    q_rows = tl.load(
        q + seq * q_stride + heads[:, None] * dim + d[None, :],
        mask=(g[:, None] < GROUP) & (d[None, :] < dim),
        other=0.0,
    )
    top = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    total = tl.zeros((GROUP_PAD,), tl.float32)
    acc = tl.zeros((GROUP_PAD, DIM), tl.float32)
    table = tables + seq * width
    for first in range(start, end, BLOCK_N):
        pos = first + tl.arange(0, BLOCK_N)
        inside = pos < end
        top, total, acc = _attend_keys(
            q_rows, cache, table, pos, inside, inside[None, :], head, kv_heads, plane_slots,
            block_size, dim, scale, top, total, acc, DIM, DOT_FP32,
        )  # fmt: skip
    # an empty split (past the sequence's end) has no scores: weight 0 in the combine
    some = total > 0
    lse = tl.where(some, top + tl.log(tl.where(some, total, 1.0)), float("-inf"))
    out = acc / tl.where(some, total, 1.0)[:, None]
    row = (seq * kv_heads * GROUP + heads) * splits + split
    tl.store(partial_lse + row, lse, mask=g < GROUP)
    tl.store(partial_out + row[:, None] * DIM + d[None, :], out, mask=(g < GROUP)[:, None])


@triton.jit
def combine_splits_kernel(
    out,  # [batch, heads, dim], contiguous
    partial_out,  # [batch, heads, splits, DIM]
    partial_lse,  # [batch, heads, splits]
    splits,
    dim,
    SPLITS: tl.constexpr,
    DIM: tl.constexpr,
):
    """One (sequence, query head): its splits' outputs, weighted by their softmax mass."""
    row = tl.program_id(0).to(tl.int64)  # sequence * heads + head
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, DIM)
    lse = tl.load(partial_lse + row * splits + s, mask=s < splits, other=float("-inf"))
    top = tl.max(lse, axis=0)  # -inf for a padding row: every weight is then 0
    weight = tl.where(lse > float("-inf"), tl.exp(lse - tl.maximum(top, -1e30)), 0.0)
    parts = tl.load(
        partial_out + (row * splits + s[:, None]) * DIM + d[None, :],
        mask=(s[:, None] < splits),
        other=0.0,
    )
    total = tl.sum(weight, axis=0)
    result = tl.sum(parts * weight[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out + row * dim + d, round_to(result, out.dtype.element_ty), mask=d < dim)


@triton.jit
def extend_kernel(
    out,  # [tokens, heads, dim], contiguous
    q,  # [tokens, heads, dim], tokens `q_stride` apart
    cache,  # holding every key and value attended to, this step's included
    tables,  # [sequences, width] int64
    q_starts,  # [sequences] int64: row of each sequence's first query
    q_lens,  # [sequences] int64: its queries, the last q_lens of its context
    context_lens,  # [sequences] int64
    q_stride,
    width,
    kv_heads,
    plane_slots,
    block_size,
    dim,
    scale,
    GROUP: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """One (sequence, query head, BLOCK_M queries): causal over the queries, full over the
    cached tokens before them."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    first_query = tl.program_id(2) * BLOCK_M
    num_queries = tl.load(q_lens + seq)
    if first_query < num_queries:
        context = tl.load(context_lens + seq)
        rows = first_query + tl.arange(0, BLOCK_M)
        row_inside = rows < num_queries
        q_pos = context - num_queries + rows  # each query's position in its sequence
        token = tl.load(q_starts + seq) + rows
        d = tl.arange(0, DIM)
        q_rows = tl.load(
            q + token[:, None] * q_stride + head * dim + d[None, :],
            mask=row_inside[:, None] & (d[None, :] < dim),
            other=0.0,
        )
        kv_head = head // GROUP
        table = tables + seq * width
        top = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        total = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, DIM), tl.float32)
        last_key = tl.minimum(context, context - num_queries + first_query + BLOCK_M)
        for first_key in range(0, last_key, BLOCK_N):
            pos = first_key + tl.arange(0, BLOCK_N)
            inside = pos < last_key
            visible = inside[None, :] & (pos[None, :] <= q_pos[:, None])  # key 0 always is
            top, total, acc = _attend_keys(
                q_rows, cache, table, pos, inside, visible, kv_head, kv_heads, plane_slots,
                block_size, dim, scale, top, total, acc, DIM, DOT_FP32,
            )  # fmt: skip
        result = acc / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(
            out + token[:, None] * (GROUP * kv_heads * dim) + head * dim + d[None, :],
            round_to(result, out.dtype.element_ty),
            mask=row_inside[:, None] & (d[None, :] < dim),
        )
