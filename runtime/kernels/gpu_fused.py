"""Triton kernels for the small ops between the matmuls: residual-add + RMSNorm, SiLU-and-mul,
and rotary embedding in place. One program per token row.

Each loads in the model's dtype, computes in float32 and rounds where the torch reference
(runtime/layers/) rounds. In the interpreter float32 matches it to the last bits; on a GPU,
Triton's exp, division and rsqrt are the fast approximate ones, a few ulp off.
Arithmetic never runs on bfloat16 values directly: Triton's interpreter (TRITON_INTERPRET=1,
how CI runs these kernels without a GPU) stores bfloat16 as raw bits and computes on those,
and it truncates float32 to bfloat16 where the GPU rounds; `round_to` rounds on both.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """float32 x rounded to `dtype`, to nearest even, as torch rounds."""
    if dtype == tl.bfloat16:  # by hand: the interpreter's cast would truncate
        bits = x.to(tl.uint32, bitcast=True)
        upper = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = (upper << 16).to(tl.float32, bitcast=True)
        return tl.where(x == x, rounded, float("nan")).to(tl.bfloat16)  # a NaN stays one
    return x.to(dtype)


@triton.jit
def add_rms_norm_kernel(
    out,  # [rows, dim]
    residual,  # [rows, dim], updated in place to residual + x; unused without HAS_RESIDUAL
    x,  # [rows, dim]
    weight,  # [dim]
    dim,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < dim
    h = tl.load(x + row * dim + cols, mask=inside, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual + row * dim + cols, mask=inside, other=0.0).to(tl.float32)
        h = round_to(h + r, out.dtype.element_ty)  # torch adds in the model's dtype
        tl.store(residual + row * dim + cols, h, mask=inside)
        h = h.to(tl.float32)
    rms = tl.rsqrt(tl.sum(h * h, axis=0) / dim + eps)
    normed = round_to(h * rms, out.dtype.element_ty).to(tl.float32)
    w = tl.load(weight + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(out + row * dim + cols, round_to(w * normed, out.dtype.element_ty), mask=inside)


@triton.jit
def silu_and_mul_kernel(
    out,  # [rows, inter]
    x,  # [rows, 2 * inter]: gate, then up
    inter,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    for start in range(0, inter, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < inter
        gate = tl.load(x + row * 2 * inter + cols, mask=inside, other=0.0).to(tl.float32)
        up = tl.load(x + row * 2 * inter + inter + cols, mask=inside, other=0.0).to(tl.float32)
        silu = round_to(gate / (1.0 + tl.exp(-gate)), out.dtype.element_ty).to(tl.float32)
        tl.store(out + row * inter + cols, round_to(silu * up, out.dtype.element_ty), mask=inside)


@triton.jit
def rotary_kernel(
    x,  # [tokens, heads, dim], heads of a token packed, tokens `token_stride` apart
    cos,  # [tokens, dim]
    sin_signed,  # [tokens, dim]: sin with the first half negated (runtime/layers/rotary.py)
    token_stride,
    heads,
    dim,
    HEADS: tl.constexpr,
    HALF: tl.constexpr,
):
    """x * cos + rotate_half(x) * sin, where rotate_half(x) = cat(-x2, x1)."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.arange(0, HEADS)[:, None]
    col = tl.arange(0, HALF)[None, :]
    inside = (head < heads) & (col < dim // 2)
    first = x + token * token_stride + head * dim + col
    x1 = tl.load(first, mask=inside, other=0.0).to(tl.float32)
    x2 = tl.load(first + dim // 2, mask=inside, other=0.0).to(tl.float32)
    table = token * dim + col
    cos1 = tl.load(cos + table, mask=col < dim // 2, other=0.0).to(tl.float32)
    cos2 = tl.load(cos + table + dim // 2, mask=col < dim // 2, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_signed + table, mask=col < dim // 2, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_signed + table + dim // 2, mask=col < dim // 2, other=0.0).to(tl.float32)
    # as torch's x.mul_(cos).addcmul_(rolled, sin): the product rounds, then one fused add
    dtype = x.dtype.element_ty
    out1 = round_to(x1 * cos1, dtype).to(tl.float32) + x2 * sin1
    out2 = round_to(x2 * cos2, dtype).to(tl.float32) + x1 * sin2
    tl.store(first, round_to(out1, dtype), mask=inside)
    tl.store(first + dim // 2, round_to(out2, dtype), mask=inside)
