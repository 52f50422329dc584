"""GGUF's block formats that cpu_quant.cpp multiplies as they are: Q8_0, Q4_0 and Q4_1 (llama.cpp's
ggml-common.h). A matrix [N, K] is N rows of K / 32 blocks, each block a float16 scale d (Q4_1:
then a float16 minimum m) and its 32 quantized weights:

    Q8_0  34 bytes  d, 32 int8 q                       w = d * q
    Q4_0  18 bytes  d, 16 bytes of two 4-bit q each    w = d * (q - 8)
    Q4_1  20 bytes  d, m, 16 bytes of nibbles          w = d * q + m

(byte j of a 4-bit block holds weight j in its low nibble and weight j + 16 in its high one.)
Here they are torch uint8 tensors [N, row_bytes], quantized and dequantized in torch exactly as
gguf-py's `gguf.quants` does (bit for bit: tests/test_quant_kernels.py), so that float weights
pushed into a quantized model become the blocks a GGUF converter would have written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32  # weights per block


@dataclass(frozen=True, slots=True)
class QuantFormat:
    name: str
    code: int  # cpu_quant.cpp's QType
    block_bytes: int
    has_min: bool  # Q4_1: a minimum after the scale
    bits: int

    def row_bytes(self, k: int) -> int:
        if k % BLOCK:
            raise ValueError(f"{self.name} rows hold whole blocks of {BLOCK}, not {k} weights")
        return k // BLOCK * self.block_bytes

    def packed_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """The uint8 shape of a float matrix `shape` [N, K] in this format."""
        rows, k = shape
        return rows, self.row_bytes(k)


FORMATS = {
    f.name: f
    for f in (
        QuantFormat("Q8_0", 0, 34, has_min=False, bits=8),
        QuantFormat("Q4_0", 1, 18, has_min=False, bits=4),
        QuantFormat("Q4_1", 2, 20, has_min=True, bits=4),
    )
}


def quant_format(name: str) -> QuantFormat:
    try:
        return FORMATS[name]
    except KeyError:
        kept = ", ".join(FORMATS)
        raise ValueError(f"no kernel multiplies {name} blocks (we keep {kept})") from None


def quantize(weight: torch.Tensor, name: str) -> torch.Tensor:
    """A float matrix [N, K] (K a multiple of 32) as blocks of format `name`: [N, row_bytes]
    uint8, the bytes gguf-py's `quantize` writes."""
    fmt = quant_format(name)
    rows, k = weight.shape
    fmt.row_bytes(k)  # whole blocks, or a ValueError
    blocks = weight.detach().to(torch.float32).reshape(rows, k // BLOCK, BLOCK)
    if name == "Q8_0":
        d = blocks.abs().amax(-1, keepdim=True) / 127
        q = _round_half_away(blocks * _inverse(d)).to(torch.int8).view(torch.uint8)
        parts = [_half_bytes(d), q]
    elif name == "Q4_0":
        # the value of largest magnitude, with its sign, is -8 d (gguf-py, llama.cpp)
        extreme = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))
        d = extreme / -8
        q = torch.trunc(blocks * _inverse(d) + 8.5).clamp(0, 15).to(torch.uint8)
        parts = [_half_bytes(d), _pack_nibbles(q)]
    else:  # Q4_1
        low, high = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
        d = (high - low) / 15
        q = torch.trunc((blocks - low) * _inverse(d) + 0.5).clamp(0, 15).to(torch.uint8)
        parts = [_half_bytes(d), _half_bytes(low), _pack_nibbles(q)]
    return torch.cat(parts, dim=-1).reshape(rows, fmt.row_bytes(k))


def dequantize(blocks: torch.Tensor, name: str) -> torch.Tensor:
    """Blocks [N, row_bytes] of format `name` as the float32 matrix [N, K] they stand for."""
    fmt = quant_format(name)
    rows = blocks.shape[0]
    per_row = blocks.shape[1] // fmt.block_bytes
    b = blocks.reshape(rows, per_row, fmt.block_bytes)
    d = _half_values(b[..., 0:2])
    if name == "Q8_0":
        values = d * b[..., 2:].contiguous().view(torch.int8).float()
    elif name == "Q4_0":
        values = d * (_unpack_nibbles(b[..., 2:]) - 8)
    else:
        values = d * _unpack_nibbles(b[..., 4:]) + _half_values(b[..., 2:4])
    return values.reshape(rows, per_row * BLOCK)


def scales_finite(blocks: torch.Tensor, name: str) -> bool:
    """Whether every block's scale (and minimum) is a finite number: a NaN or infinite one
    would turn every product it enters into NaN."""
    fmt = quant_format(name)
    b = blocks.reshape(-1, fmt.block_bytes)
    scales = _half_values(b[:, 0:4] if fmt.has_min else b[:, 0:2])
    return bool(torch.isfinite(scales).all())


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / d)


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    """gguf-py's np_roundf (C's roundf), computed as it does: floor(|x|) + floor(2 frac)."""
    a = x.abs()
    floored = torch.floor(a)
    return torch.sign(x) * (floored + torch.floor(2 * (a - floored)))


def _half_bytes(values: torch.Tensor) -> torch.Tensor:  # [..., 1] float -> [..., 2] uint8
    return values.to(torch.float16).view(torch.uint8)


def _half_values(pairs: torch.Tensor) -> torch.Tensor:  # [..., 2k] uint8 -> [..., k] float
    return pairs.contiguous().view(torch.float16).float()


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:  # [..., 32] 0..15 -> [..., 16] bytes
    return q[..., : BLOCK // 2] | (q[..., BLOCK // 2 :] << 4)


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:  # [..., 16] -> [..., 32] float
    return torch.cat([packed & 15, packed >> 4], dim=-1).float()
