"""Plain torch references shared by the Triton and the C++ kernels (no triton import, so
the CPU path and its tests can use them)."""

from __future__ import annotations

import math

import torch


def decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Sequence by sequence, in float32: the definition, not a fast path."""
    out = torch.empty_like(q)
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // kv_heads
    for b in range(q.shape[0]):
        n = int(context_lens[b])
        pos = torch.arange(n, device=q.device)
        slots = block_tables[b, pos // block_size] * block_size + pos % block_size
        k = k_cache.view(-1, kv_heads, q.shape[2])[slots].float()  # [n, kv, d]
        v = v_cache.view(-1, kv_heads, q.shape[2])[slots].float()
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        s = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale
        if window:
            s[:, pos <= n - 1 - window] = -math.inf
        out[b] = torch.einsum("hn,nhd->hd", s.softmax(-1), v).to(q.dtype)
    return out
