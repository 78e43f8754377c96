"""The triton attention backend: the step's KV write and the paged decode and prefill
kernels of `cadence.kernels`, reading the cache through the block tables (no gather,
no padded copy of any context)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from cadence.kernels.decode_attention import decode_attention
from cadence.kernels.kv_write import kv_write
from cadence.kernels.prefill_attention import prefill_attention

if TYPE_CHECKING:
    from cadence.layers.attention import AttentionContext


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    ctx: AttentionContext,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """q: [T, heads, head_dim], k/v: [T, kv_heads, head_dim] -> [T, heads, head_dim];
    decode rows first, as the context orders them."""
    kv_write(k, v, k_cache, v_cache, ctx.slot_mapping)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    d = ctx.num_decode
    if d > 0:
        decode_attention(
            q[:d],
            k_cache,
            v_cache,
            ctx.block_tables[:d],
            ctx.context_lens[:d],
            scale,
            window=window,
            out=out[:d],
        )
    if d < q.shape[0]:
        starts = ctx.query_start[d:] - ctx.query_start[d]
        prefill_attention(
            q[d:],
            k_cache,
            v_cache,
            ctx.block_tables[d:],
            starts,
            ctx.context_lens[d:],
            ctx.max_query_len,
            scale,
            window=window,
            out=out[d:],
        )
    return out
