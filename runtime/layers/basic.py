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
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)  # one fused kernel
        return self.weight * normed.to(x.dtype)


class Linear(nn.Linear):
    """nn.Linear that can hand its weight to oneDNN pre-packed, once (as torch.compile's CPU
    backend does): bf16 GEMMs of our sizes run 15-45% faster that way, with identical results.
    """

    packed: torch.Tensor | None = None

    def pack_for_cpu(self, batch_hint: int = 32) -> None:
        """Pack the weight (bf16 on CPU only: for fp32 the results would differ slightly)."""
        if self.weight.device.type == "cpu" and self.weight.dtype == torch.bfloat16:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), batch_hint)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears_for_cpu(model: nn.Module) -> None:
    if torch.backends.mkldnn.is_available():
        for module in model.modules():
            if isinstance(module, Linear):
                module.pack_for_cpu()


class FusedLinear(Linear):
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
        self.down_proj = Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
