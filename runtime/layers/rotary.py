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


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin for every position, indexed per token of a flattened batch."""

    def __init__(self, config: PretrainedConfig, head_dim: int, max_len: int) -> None:
        super().__init__()
        inv_freq, scaling = inverse_frequencies(config, head_dim)
        freqs = torch.arange(max_len, dtype=torch.float)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_len, head_dim]
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # [T, 1, head_dim]
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
