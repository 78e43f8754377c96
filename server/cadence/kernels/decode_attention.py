"""Paged decode attention: one query token per sequence against its cached context,
read through the block table (no gather). The query heads that share a KV head are
packed into one program, so each K/V tile is loaded once per group (GQA). The split-KV
variant (flash-decoding) cuts long contexts into ranges handled by separate programs
and merges their partial results by log-sum-exp, for batches too small to fill the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cadence.kernels import dot_in_f32
from cadence.kernels.kv_quant import quant_mode, scaled
from cadence.kernels.reference import decode_attention_ref  # noqa: F401 (re-exported)

LOG2E = 1.4426950408889634


@triton.jit
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    tables_ptr,
    lens_ptr,
    out_ptr,
    part_ptr,
    lse_ptr,
    scale_log2,
    window,
    tokens_per_split,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_tb,
    stride_cb,
    stride_cs,
    stride_ch,
    block_size,
    num_splits,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_F32: tl.constexpr,
    QUANT: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b).to(tl.int32)
    lo = 0
    if window > 0:
        lo = tl.maximum(seq_len - window, 0)
    hi = seq_len
    if SPLIT:
        lo = tl.maximum(lo, split * tokens_per_split)
        hi = tl.minimum(hi, (split + 1) * tokens_per_split)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gm = g < GROUP
    dm = d < HEAD_DIM
    heads = kvh * GROUP + g
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=gm[:, None] & dm[None, :],
        other=0.0,
    )
    if DOT_F32:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    # tiles aligned to BLOCK_N so every tile but the first and last is full
    for start in range((lo // BLOCK_N) * BLOCK_N, hi, BLOCK_N):
        pos = start + n
        valid = (pos >= lo) & (pos < hi)
        blk = tl.load(tables_ptr + b * stride_tb + pos // block_size, mask=valid, other=0)
        offs = blk.to(tl.int64) * stride_cb + (pos % block_size) * stride_cs + kvh * stride_ch
        kv_mask = valid[:, None] & dm[None, :]
        k = tl.load(k_cache_ptr + offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
        k = scaled(k, k_scale_ptr, offs // HEAD_DIM, valid, QUANT)
        s = tl.dot(q, tl.trans(k.to(q.dtype))) * scale_log2  # [BLOCK_G, BLOCK_N], base 2
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = scaled(v, v_scale_ptr, offs // HEAD_DIM, valid, QUANT)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
        m_i = m_new

    st_mask = gm[:, None] & dm[None, :]
    if SPLIT:
        # partial [B, H, S, D] float32 normalized by its own sum; lse [B, H, S], base 2
        empty = l_i == 0.0
        o = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, l_i)[:, None])
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        row = (b * tl.num_programs(1) * GROUP + heads) * num_splits + split
        tl.store(part_ptr + row[:, None] * HEAD_DIM + d[None, :], o, mask=st_mask)
        tl.store(lse_ptr + row, lse, mask=gm)
    else:
        o = acc / l_i[:, None]
        dst = out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=st_mask)


@triton.jit
def _merge_kernel(
    part_ptr,
    lse_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    num_heads,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    sm = s < num_splits
    row = (b * num_heads + h) * num_splits + s
    lse = tl.load(lse_ptr + row, mask=sm, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, axis=0))
    part = tl.load(
        part_ptr + row[:, None] * HEAD_DIM + d[None, :],
        mask=sm[:, None] & (d[None, :] < HEAD_DIM),
        other=0.0,
    )
    o = tl.sum(part * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(
        out_ptr + b * stride_ob + h * stride_oh + d, o.to(out_ptr.dtype.element_ty), d < HEAD_DIM
    )


def default_splits(batch: int, kv_heads: int, max_len: int, device: torch.device) -> int:
    """Split only when the batch leaves most of the GPU idle and contexts are long."""
    if device.type != "cuda" or max_len <= 1024:
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    programs = batch * kv_heads
    if programs >= sms:
        return 1
    return max(1, min(triton.cdiv(2 * sms, programs), triton.cdiv(max_len, 512)))


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [B, heads, head_dim] -> [B, heads, head_dim]. Caches [num_blocks, block_size,
    kv_heads, head_dim]; block_tables [B, max_blocks]; context_lens [B] (>= 1, the
    query's own key included). `window`: keys within the last `window` positions only.
    A quantized cache's scales in k_scale, v_scale (`cadence.kv_format`)."""
    batch, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    assert q.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
    assert k_cache.stride(-1) == 1
    out = torch.empty_like(q) if out is None else out
    if batch == 0:
        return out
    max_len = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = default_splits(batch, kv_heads, max_len, q.device)
    tokens_per_split = triton.cdiv(max_len, num_splits)
    block_d = triton.next_power_of_2(dim)
    block_n = 64 if block_d <= 128 else 32
    tokens_per_split = triton.cdiv(tokens_per_split, block_n) * block_n
    split = num_splits > 1
    if split:
        part = torch.empty(batch * heads * num_splits * dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(batch * heads * num_splits, dtype=torch.float32, device=q.device)
    else:
        part = lse = out  # unused
    quant = quant_mode(k_cache, k_scale)
    _decode_kernel[(batch, kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        k_cache if k_scale is None else k_scale,
        v_cache if v_scale is None else v_scale,
        block_tables,
        context_lens,
        out,
        part,
        lse,
        scale * LOG2E,
        window or 0,
        tokens_per_split,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_size,
        num_splits,
        GROUP=group,
        HEAD_DIM=dim,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        SPLIT=split,
        DOT_F32=dot_in_f32(q.dtype),
        QUANT=quant,
    )
    if split:
        _merge_kernel[(batch, heads)](
            part,
            lse,
            out,
            out.stride(0),
            out.stride(1),
            heads,
            num_splits,
            HEAD_DIM=dim,
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d,
        )
    return out
