"""Rotary position embeddings with every static RoPE variant that transformers knows."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

# These rescale with the length of the sequence seen so far, which a paged batch does not have.
_LENGTH_DEPENDENT = {"dynamic", "longrope"}


def inverse_frequencies(config: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim/2], attention scaling) for this checkpoint's RoPE settings."""
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type in _LENGTH_DEPENDENT:
        raise ValueError(f"RoPE type {rope_type!r} is not supported")
    if rope_type != "default":
        return ROPE_INIT_FUNCTIONS[rope_type](config)
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin for every position, looked up per token of a flattened batch.

    Hugging Face rotates with `x * cos + rotate_half(x) * sin`, where rotate_half(x) is
    cat(-x2, x1). We store sin with the first half negated, so that rotate_half(x) * sin
    becomes roll(x) * sin_signed: the same products, in three in-place-friendly ops.
    """

    def __init__(self, config: PretrainedConfig, head_dim: int, max_len: int) -> None:
        super().__init__()
        inv_freq, scaling = inverse_frequencies(config, head_dim)
        freqs = torch.arange(max_len, dtype=torch.float)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_len, head_dim]
        sign = torch.cat((-torch.ones(head_dim // 2), torch.ones(head_dim // 2)))
        self.cos: torch.Tensor
        self.sin_signed: torch.Tensor
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin_signed", emb.sin() * scaling * sign, persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """cos and signed sin for a step's tokens, looked up once and shared by every layer."""
        # index_select: a third of advanced indexing's cost, at a decode step's few rows
        cos = self.cos.index_select(0, positions).unsqueeze(1)  # [T, 1, head_dim]
        sin = self.sin_signed.index_select(0, positions).unsqueeze(1)
        if dtype != cos.dtype:
            cos, sin = cos.to(dtype), sin.to(dtype)
        return cos, sin


Rope = tuple[torch.Tensor, torch.Tensor]


def apply_rope_(rope: Rope, x: torch.Tensor) -> None:
    """Rotate x [T, heads, head_dim] in place (it may be a view into a larger tensor)."""
    cos, sin_signed = rope
    rolled = x.roll(x.shape[-1] // 2, dims=-1)  # cat(x2, x1)
    x.mul_(cos).addcmul_(rolled, sin_signed)
