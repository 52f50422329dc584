"""Sampling in Triton without sorting the vocabulary: greedy, temperature, min-p, top-k and
top-p, drawing the same token as the torch sampler (runtime/worker/sampler.py) from the same
per-request uniform number.

The torch sampler sorts the probabilities, filters them, and inverts the cumulative
distribution in sorted order: it picks the most likely token t whose `mass(p >= p_t)` exceeds
`u * total`. Every step of that depends on the order only through thresholds on the
probability, and each threshold is found by bisection on the bits of a float32 (positive
floats order as their bit patterns do), each probe one pass over the row:

- min-p keeps p >= min_p * max(p);
- top-k keeps p >= the k-th largest p (bisection on the count above a value);
- top-p keeps p_t when the kept mass above p_t is under top_p of the kept total;
- the draw takes the largest kept value v whose kept mass `p >= v` exceeds u * total.

One program per row. Ties between equal probabilities may resolve differently from a sort
(the lowest index wins here); otherwise the token is the torch sampler's.
"""

from __future__ import annotations

import triton
import triton.language as tl

ONE_BITS = tl.constexpr(0x3F800000)  # float32 1.0: no probability lies above it
PROBES = tl.constexpr(31)  # bisection steps over [0, ONE_BITS]: 2**30 < ONE_BITS + 1 < 2**31


@triton.jit
def _probs(row, cols, vocab, temperature, top, total):
    """The softmax of logits / temperature at `cols` (0 outside the row)."""
    x = tl.load(row + cols, mask=cols < vocab, other=float("-inf")) / temperature
    return tl.exp(x - top) / total


@triton.jit
def _count_at_least(row, vocab, temperature, top, total, floor, value, BLOCK: tl.constexpr):
    count = tl.full([], 0, tl.int64)
    for start in range(0, vocab, BLOCK):
        p = _probs(row, start + tl.arange(0, BLOCK), vocab, temperature, top, total)
        count += tl.sum(((p >= floor) & (p >= value)).to(tl.int64), axis=0)
    return count


@triton.jit
def _mass(
    row, vocab, temperature, top, total, floor, value, STRICT: tl.constexpr, BLOCK: tl.constexpr
):
    """Kept mass (p >= floor) of the probabilities above `value` (>= without STRICT), float64."""
    mass = tl.full([], 0.0, tl.float64)
    for start in range(0, vocab, BLOCK):
        p = _probs(row, start + tl.arange(0, BLOCK), vocab, temperature, top, total)
        above = (p > value) if STRICT else (p >= value)
        mass += tl.sum(tl.where((p >= floor) & above, p.to(tl.float64), 0.0), axis=0)
    return mass


@triton.jit
def sample_kernel(
    tokens,  # [rows] int64, out
    logits,  # [rows, vocab] float32, rows `stride` apart
    temperatures,  # [rows] float32; 0: greedy
    top_ks,  # [rows] int64; 0: all
    top_ps,  # [rows] float32
    min_ps,  # [rows] float32
    uniforms,  # [rows] float64 in (0, 1)
    vocab,
    stride,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    row = logits + r * stride
    temperature = tl.load(temperatures + r)
    scale = tl.where(temperature > 0, temperature, 1.0)
    # pass 1: the greedy token (first index of the maximum) and the largest scaled logit
    best = tl.full([], float("-inf"), tl.float32)
    best_index = tl.full([], 0, tl.int64)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(row + cols, mask=cols < vocab, other=float("-inf"))
        chunk_best = tl.max(x, axis=0)
        chunk_index = tl.min(tl.where(x == chunk_best, cols, vocab), axis=0).to(tl.int64)
        best_index = tl.where(chunk_best > best, chunk_index, best_index)
        best = tl.maximum(best, chunk_best)
    token = best_index
    if temperature > 0:
        top = best / scale
        total = tl.full([], 0.0, tl.float32)  # pass 2: the softmax's denominator
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(row + cols, mask=cols < vocab, other=float("-inf")) / scale
            total += tl.sum(tl.exp(x - top), axis=0)
        floor = tl.load(min_ps + r) * (1.0 / total)  # min-p: against the most likely token
        k = tl.load(top_ks + r)
        if k > 0:  # the largest value with at least k probabilities at or above it
            lo, hi = tl.full([], 0, tl.int32), tl.full([], ONE_BITS + 1, tl.int32)
            for _ in range(PROBES):
                mid = (lo + hi) // 2
                value = mid.to(tl.float32, bitcast=True)
                enough = _count_at_least(row, vocab, scale, top, total, floor, value, BLOCK) >= k
                lo, hi = tl.where(enough, mid, lo), tl.where(enough, hi, mid)
            floor = tl.maximum(floor, lo.to(tl.float32, bitcast=True))
        top_p = tl.load(top_ps + r)
        if top_p < 1.0:  # the smallest value whose kept mass above it is under top_p
            budget = top_p.to(tl.float64) * _mass(
                row, vocab, scale, top, total, floor, floor, False, BLOCK
            )
            lo, hi = tl.full([], -1, tl.int32), tl.full([], ONE_BITS, tl.int32)
            for _ in range(PROBES):
                mid = (lo + hi + 1) // 2
                value = mid.to(tl.float32, bitcast=True)
                under = _mass(row, vocab, scale, top, total, floor, value, True, BLOCK) < budget
                lo, hi = tl.where(under, lo, mid), tl.where(under, mid, hi)
            floor = tl.maximum(floor, hi.to(tl.float32, bitcast=True))
        # the draw: the largest kept value whose kept mass at or above it exceeds the target
        target = tl.load(uniforms + r) * _mass(
            row, vocab, scale, top, total, floor, floor, False, BLOCK
        )
        lo, hi = tl.full([], 0, tl.int32), tl.full([], ONE_BITS + 1, tl.int32)
        for _ in range(PROBES):
            mid = (lo + hi) // 2
            value = mid.to(tl.float32, bitcast=True)
            more = _mass(row, vocab, scale, top, total, floor, value, False, BLOCK) > target
            lo, hi = tl.where(more, mid, lo), tl.where(more, hi, mid)
        chosen = lo.to(tl.float32, bitcast=True)
        token = tl.full([], 0, tl.int64) + vocab  # the first index holding that value
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            p = _probs(row, cols, vocab, scale, top, total)
            hit = tl.min(tl.where((p == chosen) & (cols < vocab), cols, vocab), axis=0)
            token = tl.minimum(token, hit.to(tl.int64))
    tl.store(tokens + r, token)
