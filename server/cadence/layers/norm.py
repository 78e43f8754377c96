"""RMSNorm with an optional fused residual add, and LayerNorm."""

from __future__ import annotations

import torch
from torch import nn

from cadence.kernels import cpu as cpu_kernels


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual)."""
        if x.dim() == 2 and cpu_kernels.enabled_for(x) and x.dtype == self.weight.dtype:
            out, new_residual = cpu_kernels.rms_norm(x, self.weight, self.eps, residual)
            return out if new_residual is None else (out, new_residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class LayerNorm(nn.LayerNorm):
    """torch's LayerNorm, its parameters created empty and filled from the checkpoint."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, affine: bool = True) -> None:
        super().__init__(hidden_size, eps=eps, elementwise_affine=affine)
