"""Paged decode (plain and split-KV) and prefill attention against their torch
references, on ragged batches over shuffled blocks."""

from __future__ import annotations

import pytest
import torch
from cadence.kernels.decode_attention import decode_attention, decode_attention_ref
from cadence.kernels.prefill_attention import prefill_attention, prefill_attention_ref
from kernel_cases import DEVICE, assert_close, paged_cache, poisoned

# lengths: 1, exact block multiples, one past a boundary, and ragged ones
LENS = {8: [1, 8, 9, 16, 23], 16: [1, 16, 17, 40, 70], 32: [1, 31, 32, 33, 100]}


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_decode_matches_reference(block_size: int, head_dim: int, group: int) -> None:
    dtype, kv_heads = torch.float32, 2
    lens = LENS[block_size]
    k_cache, v_cache, tables = paged_cache(lens, block_size, kv_heads, head_dim, dtype, seed=1)
    q = torch.randn(len(lens), kv_heads * group, head_dim, dtype=dtype, device=DEVICE)
    context_lens = torch.tensor(lens, device=DEVICE)
    scale = head_dim**-0.5
    out = decode_attention(
        q, k_cache, v_cache, tables, context_lens, scale, out=poisoned(q.shape, dtype)
    )
    expected = decode_attention_ref(q, k_cache, v_cache, tables, context_lens, scale)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("num_splits", [2, 3, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_kv_decode_matches_reference(num_splits: int, dtype: torch.dtype) -> None:
    """More splits than a short sequence has tiles: the empty splits must merge away."""
    lens, block_size, kv_heads, group, head_dim = [1, 64, 65, 300], 16, 2, 3, 64
    k_cache, v_cache, tables = paged_cache(lens, block_size, kv_heads, head_dim, dtype, seed=2)
    q = torch.randn(len(lens), kv_heads * group, head_dim, device=DEVICE).to(dtype)
    context_lens = torch.tensor(lens, device=DEVICE)
    out = decode_attention(
        q,
        k_cache,
        v_cache,
        tables,
        context_lens,
        0.125,
        num_splits=num_splits,
        out=poisoned(q.shape, dtype),
    )
    expected = decode_attention_ref(q, k_cache, v_cache, tables, context_lens, 0.125)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_sliding_window(num_splits: int) -> None:
    lens, block_size, window = [1, 20, 50, 130], 16, 24
    k_cache, v_cache, tables = paged_cache(lens, block_size, 1, 64, torch.float32, seed=3)
    q = torch.randn(len(lens), 3, 64, device=DEVICE)
    context_lens = torch.tensor(lens, device=DEVICE)
    out = decode_attention(
        q, k_cache, v_cache, tables, context_lens, 0.125, window=window, num_splits=num_splits
    )
    expected = decode_attention_ref(q, k_cache, v_cache, tables, context_lens, 0.125, window)
    assert_close(out, expected, torch.float32)


def _prefill_case(
    chunks: list[tuple[int, int]],
    block_size: int,
    kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int,
) -> tuple[torch.Tensor, ...]:
    """chunks: (cached prefix length, new tokens) per sequence."""
    lens = [p + n for p, n in chunks]
    k_cache, v_cache, tables = paged_cache(lens, block_size, kv_heads, head_dim, dtype, seed)
    q_lens = torch.tensor([n for _, n in chunks])
    starts = torch.zeros(len(chunks) + 1, dtype=torch.int64)
    starts[1:] = q_lens.cumsum(0)
    q = torch.randn(int(starts[-1]), kv_heads * group, head_dim).to(dtype)
    return q.to(DEVICE), k_cache, v_cache, tables, starts.to(DEVICE), torch.tensor(lens).to(DEVICE)


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_prefill_matches_reference(block_size: int, head_dim: int, group: int) -> None:
    """Whole prompts, a one-token chunk, chunks after a cached prefix (chunked prefill or
    a prefix-cache hit), one longer than a query tile."""
    chunks = [(0, 1), (0, 17), (block_size, 5), (9, 1), (30, 70)]
    dtype = torch.float32
    q, k_cache, v_cache, tables, starts, lens = _prefill_case(
        chunks, block_size, 2, group, head_dim, dtype, seed=4
    )
    max_q = max(n for _, n in chunks)
    scale = head_dim**-0.5
    out = prefill_attention(
        q, k_cache, v_cache, tables, starts, lens, max_q, scale, out=poisoned(q.shape, dtype)
    )
    expected = prefill_attention_ref(q, k_cache, v_cache, tables, starts, lens, max_q, scale)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_half_precision(dtype: torch.dtype) -> None:
    chunks = [(0, 33), (16, 16), (5, 2)]
    q, k_cache, v_cache, tables, starts, lens = _prefill_case(chunks, 16, 1, 3, 64, dtype, 5)
    out = prefill_attention(
        q, k_cache, v_cache, tables, starts, lens, 33, 0.125, out=poisoned(q.shape, dtype)
    )
    expected = prefill_attention_ref(q, k_cache, v_cache, tables, starts, lens, 33, 0.125)
    assert_close(out, expected, dtype)


def test_prefill_sliding_window() -> None:
    chunks = [(0, 40), (50, 20), (3, 1)]
    q, k_cache, v_cache, tables, starts, lens = _prefill_case(
        chunks, 16, 2, 3, 64, torch.float32, 6
    )
    out = prefill_attention(q, k_cache, v_cache, tables, starts, lens, 40, 0.125, window=10)
    expected = prefill_attention_ref(q, k_cache, v_cache, tables, starts, lens, 40, 0.125, 10)
    assert_close(out, expected, torch.float32)
