"""Activations: SwiGLU over a fused gate/up projection, and the plain ones by their
config.json names (OPT's ReLU, GPT-2's tanh-approximated GELU)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from cadence.kernels import cpu as cpu_kernels


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and cpu_kernels.enabled_for(x):
            return cpu_kernels.silu_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_new": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_fast": _gelu_tanh,
    "silu": F.silu,
    "swish": F.silu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r} (one of {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]
