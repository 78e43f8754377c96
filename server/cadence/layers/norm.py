"""RMSNorm with an optional fused residual add, and LayerNorm."""

from __future__ import annotations

import torch
from torch import nn

from cadence.layers.kernel_ops import UsesLayerOps


class RMSNorm(UsesLayerOps, nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual)."""
        out, new_residual = self.ops.rms_norm(x, self.weight, self.eps, residual)
        return out if new_residual is None else (out, new_residual)


class LayerNorm(nn.LayerNorm):
    """torch's LayerNorm, its parameters created empty and filled from the checkpoint."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, affine: bool = True) -> None:
        super().__init__(hidden_size, eps=eps, elementwise_affine=affine)
