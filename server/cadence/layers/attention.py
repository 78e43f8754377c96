"""One layer's attention over its slice of the paged KV cache. Which implementation runs
is the step's attention backend (`cadence.attention_backends`), installed by the model
runner for the duration of a forward; the layer holds only its shape and its caches."""

from __future__ import annotations

import torch
from torch import nn

from cadence.attention_backends import get_context
from cadence.heartbeat import HEARTBEAT


class Attention(nn.Module):
    """The engine assigns `k_cache` and `v_cache` once the cache is allocated, and with a
    quantized cache their scales `k_scale` and `v_scale` (`cadence.kv_cache.KVCache.scales`;
    None for a float cache)."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window  # None: full causal attention
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, heads, head_dim], k/v: [T, kv_heads, head_dim] -> [T, heads * head_dim]."""
        step = get_context()
        HEARTBEAT.beat()  # a layer's worth of progress, seen by Health
        out = step.backend.forward(self, q, k, v, step.metadata)
        return out.reshape(q.shape[0], -1)
