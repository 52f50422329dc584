"""Small building blocks shared by the Llama-family models."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 exactly as Hugging Face does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class FusedLinear(nn.Linear):
    """Several projections of the same input in one matmul (q/k/v, or gate/up).

    `shard_sizes` gives the output rows of each part, in order, so the loader can copy the
    checkpoint's separate tensors into their slices.
    """

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(shard_sizes), bias=bias)
        self.shard_sizes = shard_sizes

    def shard(self, tensor: torch.Tensor, index: int) -> torch.Tensor:
        start = sum(self.shard_sizes[:index])
        return tensor.narrow(0, start, self.shard_sizes[index])


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)): the SwiGLU feed-forward of Llama and friends."""

    def __init__(self, hidden: int, intermediate: int, bias: bool) -> None:
        super().__init__()
        self.gate_up_proj = FusedLinear(hidden, [intermediate, intermediate], bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
