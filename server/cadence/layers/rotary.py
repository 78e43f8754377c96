"""Rotary position embeddings (the rotate-half layout of Hugging Face Llama), with the
"linear" and "llama3" frequency scalings."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cadence.layers.kernel_ops import RotaryFn, UsesLayerOps


def rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """The rope settings of a config.json, whether written by transformers 4
    (`rope_theta` + `rope_scaling`) or 5 (`rope_parameters`)."""
    params = dict(config.get("rope_parameters") or {})
    scaling = config.get("rope_scaling") or {}
    params = {**scaling, **params}
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    return params


def inverse_frequencies(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """Computed on the CPU (as transformers does) and moved to the default device: on the
    meta device, `float ** tensor` goes through torch's reference ops, whose first use
    imports torch._dynamo (1.6 s of a shard's start)."""
    return _inverse_frequencies(head_dim, params).to(torch.get_default_device())


def _inverse_frequencies(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    base = float(params["rope_theta"])
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (base**exponents)
    kind = params["rope_type"]
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(params["factor"])
    if kind == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: linear, llama3)")


@dataclass(slots=True)
class Rope:
    """One forward's rotary angles, shared by every layer, and the kernel that applies
    them."""

    cos: torch.Tensor  # [T, 1, head_dim] in the activations' dtype
    sin: torch.Tensor
    rotate: RotaryFn

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim] -> rotated (in place where the kernel can)."""
        return self.rotate(x, self.cos, self.sin)


class RotaryEmbedding(UsesLayerOps, nn.Module):
    """`angles(positions)` is computed once per forward and shared by every layer."""

    def __init__(self, head_dim: int, params: dict[str, Any]) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inverse_frequencies(head_dim, params), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.unsqueeze(0)
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)  # [T, 1, head_dim]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def angles(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        cos, sin = self.cos_sin(positions, dtype)
        return Rope(cos, sin, self.ops.rotary)
