"""Paged prefill attention for a batch of variable-length query chunks. Each chunk's
keys and values are already in the cache (written before attention), so a chunk reads
its cached prefix and itself through the block table, causally, with an online softmax
over key tiles (FlashAttention-style): chunked prefill and prefix-cache hits need no
copy of the prefix."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from cadence.kernels import dot_in_f32
from cadence.kernels.kv_quant import quant_mode, scaled

LOG2E = 1.4426950408889634


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    tables_ptr,
    starts_ptr,
    lens_ptr,
    out_ptr,
    scale_log2,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_tb,
    stride_cb,
    stride_cs,
    stride_ch,
    block_size,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_F32: tl.constexpr,
    QUANT: tl.constexpr,
):
    tile = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    kvh = h // GROUP
    q_start = tl.load(starts_ptr + b).to(tl.int32)
    q_len = tl.load(starts_ptr + b + 1).to(tl.int32) - q_start
    if tile * BLOCK_M >= q_len:
        return
    ctx_len = tl.load(lens_ptr + b).to(tl.int32)
    first = ctx_len - q_len  # position of the chunk's first query

    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    mm = m < q_len
    dm = d < HEAD_DIM
    q_pos = first + m
    q = tl.load(
        q_ptr + (q_start + m)[:, None] * stride_qt + h * stride_qh + d[None, :],
        mask=mm[:, None] & dm[None, :],
        other=0.0,
    )
    if DOT_F32:
        q = q.to(tl.float32)
    hi = tl.minimum(ctx_len, first + tile * BLOCK_M + BLOCK_M)  # causal bound of the tile
    lo = 0
    if window > 0:
        lo = tl.maximum(first + tile * BLOCK_M - window + 1, 0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    for start in range((lo // BLOCK_N) * BLOCK_N, hi, BLOCK_N):
        pos = start + n
        in_ctx = (pos >= lo) & (pos < hi)
        blk = tl.load(tables_ptr + b * stride_tb + pos // block_size, mask=in_ctx, other=0)
        offs = blk.to(tl.int64) * stride_cb + (pos % block_size) * stride_cs + kvh * stride_ch
        kv_mask = in_ctx[:, None] & dm[None, :]
        k = tl.load(k_cache_ptr + offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
        k = scaled(k, k_scale_ptr, offs // HEAD_DIM, in_ctx, QUANT)
        s = tl.dot(q, tl.trans(k.to(q.dtype))) * scale_log2
        visible = in_ctx[None, :] & (pos[None, :] <= q_pos[:, None])
        if window > 0:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing seen yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = scaled(v, v_scale_ptr, offs // HEAD_DIM, in_ctx, QUANT)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
        m_i = m_new
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    dst = out_ptr + (q_start + m)[:, None] * stride_ot + h * stride_oh + d[None, :]
    tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=mm[:, None] & dm[None, :])


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    window: int | None = None,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, heads, head_dim], the chunks packed, chunk b = q[query_start[b] :
    query_start[b + 1]] at positions context_lens[b] - its length onwards -> same shape.
    A quantized cache's scales in k_scale, v_scale (`cadence.kv_format`)."""
    tokens, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    assert q.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
    out = torch.empty_like(q) if out is None else out
    batch = context_lens.shape[0]
    if tokens == 0 or batch == 0:
        return out
    block_m = 64 if max_query_len > 32 else 16
    grid = (triton.cdiv(max_query_len, block_m), batch, heads)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        k_cache if k_scale is None else k_scale,
        v_cache if v_scale is None else v_scale,
        block_tables,
        query_start,
        context_lens,
        out,
        scale * LOG2E,
        window or 0,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_size,
        GROUP=heads // kv_heads,
        HEAD_DIM=dim,
        BLOCK_M=block_m,
        BLOCK_N=64,
        BLOCK_D=triton.next_power_of_2(dim),
        DOT_F32=dot_in_f32(q.dtype),
        QUANT=quant_mode(k_cache, k_scale),
    )
    return out


def prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Sequence by sequence, in float32."""
    del max_query_len
    out = torch.empty_like(q)
    block_size, kv_heads, dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // kv_heads
    for b in range(context_lens.shape[0]):
        s0, s1 = int(query_start[b]), int(query_start[b + 1])
        n = int(context_lens[b])
        pos = torch.arange(n, device=q.device)
        slots = block_tables[b, pos // block_size] * block_size + pos % block_size
        k = k_cache.view(-1, kv_heads, dim)[slots].float().repeat_interleave(group, dim=1)
        v = v_cache.view(-1, kv_heads, dim)[slots].float().repeat_interleave(group, dim=1)
        q_pos = torch.arange(n - (s1 - s0), n, device=q.device)
        s = torch.einsum("thd,nhd->htn", q[s0:s1].float(), k) * scale
        hidden = pos[None, :] > q_pos[:, None]
        if window:
            hidden |= pos[None, :] <= q_pos[:, None] - window
        s = s.masked_fill(hidden, -math.inf)
        out[s0:s1] = torch.einsum("htn,nhd->thd", s.softmax(-1), v).to(q.dtype)
    return out
