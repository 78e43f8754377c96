"""Plain torch references shared by the Triton and the C++ kernels (no triton import, so
the CPU path and its tests can use them)."""

from __future__ import annotations

import math

import torch

from cadence.lora.products import ExpandTables, ShrinkTables


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


def lora_shrink_ref(x: torch.Tensor, t: ShrinkTables) -> torch.Tensor:
    """h [T, Rmax]: for each row t of adapter a, h[t, :R] = x[t] @ Aᵀ with A the rows
    `rows_in[a_idx[a, :R]]` (R = ranks[a]), in float32, rounded to x's dtype; zero past R
    and on rows without an adapter. Adapter by adapter: gather, then one matmul."""
    rows_in, a_idx, ranks, row_adapter = t.rows_in, t.a_idx, t.ranks, t.row_adapter
    h = torch.zeros(x.shape[0], a_idx.shape[1], dtype=x.dtype, device=x.device)
    for a in range(a_idx.shape[0]):
        rows = (row_adapter == a).nonzero().flatten()
        rank = int(ranks[a])
        if rows.numel() == 0 or rank == 0:
            continue
        a_mat = rows_in[a_idx[a, :rank].long()].float()  # [R, in]
        h[rows, :rank] = (x[rows].float() @ a_mat.t()).to(x.dtype)
    return h


def lora_expand_ref_(y: torch.Tensor, h: torch.Tensor, t: ExpandTables) -> None:
    """In place: for each row t of adapter a, y[t, out_offset : out_offset + out] +=
    h[t, s : s + r] @ Bᵀ with Bᵀ the rows `rows_out[b_idx[a, :r]]` (r = piece_ranks[a], s
    = rank_start[a]); the sum in float32, rounded once to y's dtype. Other rows and
    columns are left as they are."""
    rows_out, b_idx, out_offset, row_adapter = t.rows_out, t.b_idx, t.out_offset, t.row_adapter
    piece_ranks, rank_start = t.piece_ranks, t.rank_start
    cols = slice(out_offset, out_offset + rows_out.shape[1])
    for a in range(b_idx.shape[0]):
        rows = (row_adapter == a).nonzero().flatten()
        rank, start = int(piece_ranks[a]), int(rank_start[a])
        if rows.numel() == 0 or rank == 0:
            continue
        b_t = rows_out[b_idx[a, :rank].long()].float()  # [r, out]
        delta = h[rows, start : start + rank].float() @ b_t
        y[rows, cols] = (y[rows, cols].float() + delta).to(y.dtype)
