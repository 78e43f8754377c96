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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sequence by sequence, in float32: the definition, not a fast path. A quantized
    cache (`cadence.kv_format`) is read times its scales: int8's per slot and KV head
    [num_blocks, block_size, kv_heads], fp8's one per layer."""
    out = torch.empty_like(q)
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // kv_heads

    def read(cache: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor):
        x = cache.view(-1, kv_heads, q.shape[2])[slots].float()  # [n, kv, d]
        if scales is None:
            return x
        if scales.numel() == 1:
            return x * scales.float().reshape(())
        return x * scales.reshape(-1, kv_heads)[slots].float().unsqueeze(-1)

    for b in range(q.shape[0]):
        n = int(context_lens[b])
        pos = torch.arange(n, device=q.device)
        slots = block_tables[b, pos // block_size] * block_size + pos % block_size
        k = read(k_cache, k_scale, slots)
        v = read(v_cache, v_scale, slots)
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        s = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale
        if window:
            s[:, pos <= n - 1 - window] = -math.inf
        out[b] = torch.einsum("hn,nhd->hd", s.softmax(-1), v).to(q.dtype)
    return out
