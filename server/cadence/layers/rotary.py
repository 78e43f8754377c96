"""Rotary position embeddings (the rotate-half layout of Hugging Face Llama), with the
"linear" and "llama3" frequency scalings."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from cadence.kernels import cpu as cpu_kernels


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
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
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


class RotaryEmbedding(nn.Module):
    """`cos_sin(positions)` is computed once per forward and shared by every layer."""

    def __init__(self, head_dim: int, params: dict[str, Any]) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inverse_frequencies(head_dim, params), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.unsqueeze(0)
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)  # [T, 1, head_dim]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]. On CPU, in place through the C++ kernel when x's heads
    are packed (x is then returned rotated); elsewhere a new tensor."""
    if (
        cpu_kernels.enabled_for(x)
        and x.stride(2) == 1
        and x.stride(1) == x.shape[2]
        and cos.dtype == x.dtype
    ):
        return cpu_kernels.rotary_(x, cos, sin)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
