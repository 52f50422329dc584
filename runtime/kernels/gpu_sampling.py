"""Sampling in Triton without sorting the vocabulary: greedy, temperature, min-p, top-k and
top-p, drawing the torch sampler's token (runtime/worker/sampler.py) from the same
per-request uniform number.

The torch sampler sorts the probabilities (most likely first, equal ones by index), filters
them, and inverts the cumulative distribution in that order. Every step depends on the order
only through a cut in it: a value v and, among the tokens of probability exactly v, the
last index kept. So each filter here finds its cut:

- min-p keeps p >= min_p * max(p), every tie included;
- top-k finds the k-th largest value by bisection on the count at or above a value (positive
  floats order as their bit patterns do: each probe is one pass over the row), then keeps
  the ties there that fit in k, by index;
- top-p finds the smallest value whose kept mass above it is under top_p of the kept total,
  then keeps the ties there whose mass before them is still under it;
- the draw finds the largest kept value whose kept mass at or above it exceeds u * total,
  then the tie there that the target falls in.

The cuts combine into one: the later in the order. Masses are float64, as the torch
sampler's cumulative sum is. One program per row. On a GPU the exponentials are Triton's fast
ones, so a target within rounding of a boundary may fall on the other side of it.
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
def _kept(p, cols, vocab, cut_value, cut_index):
    """Tokens at or before the cut: more likely than cut_value, or as likely and not later."""
    return (cols < vocab) & ((p > cut_value) | ((p == cut_value) & (cols <= cut_index)))


# which probabilities `_tally` counts or weighs, against a value
ABOVE = tl.constexpr(0)  # p > value
AT_OR_ABOVE = tl.constexpr(1)  # p >= value
AT = tl.constexpr(2)  # p == value


@triton.jit
def _tally(row, vocab, temperature, top, total, cut_value, cut_index, value, WHERE: tl.constexpr,
           MASS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Over the kept tokens where p compares to `value` as WHERE says: their probability
    mass (MASS) or their count, in float64 (exact for counts)."""
    tally = tl.full([], 0.0, tl.float64)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        p = _probs(row, cols, vocab, temperature, top, total)
        if WHERE == ABOVE:
            where = p > value
        elif WHERE == AT_OR_ABOVE:
            where = p >= value
        else:
            where = p == value
        keep = _kept(p, cols, vocab, cut_value, cut_index) & where
        weight = p.to(tl.float64) if MASS else tl.full(p.shape, 1.0, tl.float64)
        tally += tl.sum(tl.where(keep, weight, 0.0), axis=0)
    return tally


@triton.jit
def _nth(row, vocab, temperature, top, total, cut_value, cut_index, value, n, BLOCK: tl.constexpr):
    """The index of the n-th (from 1) kept token of probability exactly `value`."""
    seen = tl.full([], 0, tl.int64)
    found = tl.full([], 0, tl.int64) + vocab
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        p = _probs(row, cols, vocab, temperature, top, total)
        tie = _kept(p, cols, vocab, cut_value, cut_index) & (p == value)
        order = seen + tl.cumsum(tie.to(tl.int64), axis=0)
        hit = tl.min(tl.where(tie & (order == n), cols, vocab), axis=0).to(tl.int64)
        found = tl.minimum(found, hit)
        seen += tl.sum(tie.to(tl.int64), axis=0)
    return found


@triton.jit
def _tighter(value_a, index_a, value_b, index_b):
    """The later of two cuts (the one that keeps fewer tokens)."""
    later = (value_b > value_a) | ((value_b == value_a) & (index_b < index_a))
    return tl.where(later, value_b, value_a), tl.where(later, index_b, index_a)


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
    t = tl.where(temperature > 0, temperature, 1.0)
    # pass 1: the greedy token (first index of the maximum) and the largest logit
    best = tl.full([], float("-inf"), tl.float32)
    token = tl.full([], 0, tl.int64)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(row + cols, mask=cols < vocab, other=float("-inf"))
        chunk_best = tl.max(x, axis=0)
        chunk_index = tl.min(tl.where(x == chunk_best, cols, vocab), axis=0).to(tl.int64)
        token = tl.where(chunk_best > best, chunk_index, token)
        best = tl.maximum(best, chunk_best)
    if temperature > 0:
        top = best / t
        total = tl.full([], 0.0, tl.float32)  # pass 2: the softmax's denominator
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(row + cols, mask=cols < vocab, other=float("-inf")) / t
            total += tl.sum(tl.exp(x - top), axis=0)
        last = tl.full([], 0, tl.int64) + vocab - 1
        # min-p, against the most likely token (probability 1 / total): its ties all stay
        cut_value, cut_index = tl.load(min_ps + r) * (1.0 / total), last
        k = tl.load(top_ks + r)
        if k > 0:  # over all tokens, as the sampler ranks them before it drops any
            lo, hi = tl.full([], 0, tl.int32), tl.full([], ONE_BITS + 1, tl.int32)
            for _ in range(PROBES):  # the largest value with k tokens at or above it
                mid = (lo + hi) // 2
                value = mid.to(tl.float32, bitcast=True)
                count = _tally(
                    row, vocab, t, top, total, 0.0, last, value, AT_OR_ABOVE, False, BLOCK
                )
                lo, hi = tl.where(count >= k, mid, lo), tl.where(count >= k, hi, mid)
            value = lo.to(tl.float32, bitcast=True)
            above = _tally(row, vocab, t, top, total, 0.0, last, value, ABOVE, False, BLOCK)
            index = _nth(row, vocab, t, top, total, 0.0, last, value, k - above.to(tl.int64), BLOCK)
            cut_value, cut_index = _tighter(cut_value, cut_index, value, index)
        top_p = tl.load(top_ps + r)
        if top_p < 1.0:
            kept = _tally(
                row, vocab, t, top, total, cut_value, cut_index, 0.0, AT_OR_ABOVE, True, BLOCK
            )
            budget = top_p.to(tl.float64) * kept
            lo, hi = tl.full([], -1, tl.int32), tl.full([], ONE_BITS, tl.int32)
            for _ in range(PROBES):  # the smallest value whose kept mass above is < budget
                mid = (lo + hi + 1) // 2
                value = mid.to(tl.float32, bitcast=True)
                mass = _tally(
                    row, vocab, t, top, total, cut_value, cut_index, value, ABOVE, True, BLOCK
                )
                lo, hi = tl.where(mass < budget, lo, mid), tl.where(mass < budget, mid, hi)
            value = hi.to(tl.float32, bitcast=True)
            above = _tally(
                row, vocab, t, top, total, cut_value, cut_index, value, ABOVE, True, BLOCK
            )
            ties = _tally(
                row, vocab, t, top, total, cut_value, cut_index, value, AT, False, BLOCK
            ).to(tl.int64)
            # tie j has mass above + j * value before it: those under the budget stay
            fit = tl.ceil((budget - above) / value.to(tl.float64)).to(tl.int64)
            n = tl.minimum(tl.maximum(fit, 1), ties)
            index = _nth(row, vocab, t, top, total, cut_value, cut_index, value, n, BLOCK)
            cut_value, cut_index = _tighter(cut_value, cut_index, value, index)
        # the draw: the largest kept value whose kept mass at or above it exceeds the target
        kept = _tally(
            row, vocab, t, top, total, cut_value, cut_index, 0.0, AT_OR_ABOVE, True, BLOCK
        )
        target = tl.load(uniforms + r) * kept
        lo, hi = tl.full([], 0, tl.int32), tl.full([], ONE_BITS + 1, tl.int32)
        for _ in range(PROBES):
            mid = (lo + hi) // 2
            value = mid.to(tl.float32, bitcast=True)
            mass = _tally(
                row, vocab, t, top, total, cut_value, cut_index, value, AT_OR_ABOVE, True, BLOCK
            )
            lo, hi = tl.where(mass > target, mid, lo), tl.where(mass > target, hi, mid)
        value = lo.to(tl.float32, bitcast=True)
        above = _tally(row, vocab, t, top, total, cut_value, cut_index, value, ABOVE, True, BLOCK)
        ties = _tally(row, vocab, t, top, total, cut_value, cut_index, value, AT, False, BLOCK).to(
            tl.int64
        )
        # tie j covers [above + j * value, above + (j + 1) * value) of the cumulative mass
        j = tl.floor((target - above) / value.to(tl.float64)).to(tl.int64)
        n = tl.minimum(tl.maximum(j, 0) + 1, ties)
        token = _nth(row, vocab, t, top, total, cut_value, cut_index, value, n, BLOCK)
    tl.store(tokens + r, token)
