"""Small building blocks shared by the Llama-family models."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.kernels.select import Kernels


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 exactly as Hugging Face does; with the CPU
    kernels, one pass that rounds where torch's ops round."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, kernels: Kernels | None = None) -> torch.Tensor:
        if self._fused(x, kernels):
            assert kernels is not None
            return kernels.rms_norm(x, self.weight, self.eps)
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return self.weight * normed.to(x.dtype)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor, kernels: Kernels | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): the residual stream's next value and its norm.
        The kernels update `residual` in place; the torch path leaves it alone."""
        if self._fused(x, kernels) and residual.is_contiguous():
            assert kernels is not None
            return kernels.rms_norm(x, self.weight, self.eps, residual), residual
        residual = residual + x
        return self.forward(residual), residual

    def _fused(self, x: torch.Tensor, kernels: Kernels | None) -> bool:
        return (
            kernels is not None
            and x.dim() == 2
            and x.is_contiguous()
            and x.dtype == self.weight.dtype
        )


class Linear(nn.Linear):
    """nn.Linear that can hand its weight to oneDNN pre-packed, once (as torch.compile's CPU
    backend does): bf16 GEMMs of our sizes run 15-45% faster that way, with identical results.
    """

    packed: torch.Tensor | None = None

    def pack_for_cpu(self, batch_hint: int = 32) -> None:
        """Pack the weight (bf16 on CPU only: for fp32 the results would differ slightly;
        and only where oneDNN has a bf16 path: AVX-512 or AVX-NE-CONVERT, not plain AVX2)."""
        if (
            self.weight.device.type == "cpu"
            and self.weight.dtype == torch.bfloat16
            and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        ):
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
