"""Activations: SwiGLU over a fused gate/up projection, and the plain ones by their
config.json names (OPT's ReLU, GPT-2's tanh-approximated GELU)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from cadence.layers.kernel_ops import UsesLayerOps


class SiluAndMul(UsesLayerOps, nn.Module):
    """SwiGLU over a fused [T, 2 * inter] gate/up projection -> [T, inter]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_mul(x)


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
