"""The LoRA products over a step's rows (`cadence.lora.torch_ops`) against a dense
reference (x @ Aᵀ, then each piece's slice of it @ Bᵀ), for rows of mixed adapters of
different ranks, rows without one, adapters with many rows (one matmul per segment) and
with few (per-row gathers)."""

from __future__ import annotations

import pytest
import torch
from cadence.lora.products import ExpandTables, ShrinkTables
from cadence.lora.torch_ops import SEGMENT_MIN_ROWS, lora_expand_, lora_shrink, segments_of

IN, OUT = 48, 40
RANKS = [4, 8, 0, 3]  # adapter 2 leaves this layer alone
PIECE = [(0, 16, [2, 5, 0, 1]), (16, 24, [2, 3, 0, 2])]  # (out_offset, out, piece ranks)


def tables(g: torch.Generator, dtype: torch.dtype):
    """Pools of rows (one per width), each adapter's A rows and per piece its B rows in
    them (shuffled)."""
    rows_in = torch.randn(200, IN, generator=g).to(dtype)
    rmax = max(RANKS)
    perm = torch.randperm(200, generator=g)
    a_idx = torch.zeros(len(RANKS), rmax, dtype=torch.long)
    taken = 0
    for a, r in enumerate(RANKS):
        real = perm[taken : taken + max(r, 1)]
        taken += max(r, 1)
        a_idx[a] = torch.cat([real, real[-1:].expand(rmax - len(real))])
    pieces = []
    for offset, out, piece_ranks in PIECE:
        rp = max(piece_ranks)
        b_idx = torch.zeros(len(RANKS), rp, dtype=torch.long)
        rank_start = torch.tensor([2, 5, 0, 1] if offset else [0, 0, 0, 0])
        for a, r in enumerate(piece_ranks):
            real = perm[taken : taken + max(r, 1)]
            taken += max(r, 1)
            b_idx[a] = torch.cat([real, real[-1:].expand(rp - len(real))])
        rows_out = torch.randn(200, out, generator=g).to(dtype)
        pieces.append((offset, rows_out, b_idx, torch.tensor(piece_ranks), rank_start))
    return rows_in, a_idx, pieces


def dense(x, rows_in, a_idx, pieces, row_adapter, y0):
    """Row by row in float64: y0 + the pieces' products of x @ Aᵀ."""
    y = y0.double().clone()
    for t, a in enumerate(row_adapter.tolist()):
        if a < 0 or RANKS[a] == 0:
            continue
        h = x[t].double() @ rows_in[a_idx[a, : RANKS[a]]].double().T
        for offset, rows_out, b_idx, piece_ranks, rank_start in pieces:
            r, s = int(piece_ranks[a]), int(rank_start[a])
            if r:
                end = offset + rows_out.shape[1]
                y[t, offset:end] += h[s : s + r] @ rows_out[b_idx[a, :r]].double()
    return y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shrink_and_expand_match_the_dense_products(dtype):
    g = torch.Generator().manual_seed(0)
    rows_in, a_idx, pieces = tables(g, dtype)
    # decode rows of every adapter and none, then a long chunk of adapter 1 (a segment),
    # a short chunk of adapter 3, a chunk without adapter, adapter 0's rows in two chunks
    # that together make a segment
    per_row = [0, 1, -1, 3, 2, 1, -1, 0]
    long = [1] * (SEGMENT_MIN_ROWS + 5)
    row_adapter = torch.tensor(per_row + long + [3] * 3 + [-1] * 4 + [0] * 4 + [2] * 2 + [0] * 6)
    segments = segments_of(row_adapter)
    assert segments.big and segments.small_rows is not None  # both paths run
    x = torch.randn(len(row_adapter), IN, generator=g).to(dtype)
    y0 = torch.randn(len(row_adapter), OUT + 8, generator=g).to(dtype)

    ranks = torch.tensor(RANKS)
    h = lora_shrink(x, ShrinkTables(rows_in, a_idx, ranks, row_adapter))
    for t, a in enumerate(row_adapter.tolist()):  # zero past each row's rank
        r = RANKS[a] if a >= 0 else 0
        assert not h[t, r:].any(), t
    y = y0.clone()
    for offset, rows_out, b_idx, piece_ranks, rank_start in pieces:
        lora_expand_(
            y, h, ExpandTables(rows_out, b_idx, piece_ranks, rank_start, offset, row_adapter)
        )
    want = dense(x, rows_in, a_idx, pieces, row_adapter, y0)
    # float32: rounding only; bfloat16: the products' inputs and outputs rounded to 8 bits
    atol, rtol = (1e-5, 1e-6) if dtype == torch.float32 else (0.1, 0.02)
    torch.testing.assert_close(y.double(), want, atol=atol, rtol=rtol)
    untouched = (row_adapter < 0) | (row_adapter == 2)
    assert torch.equal(y[untouched], y0[untouched])
    assert torch.equal(y[:, OUT:], y0[:, OUT:])  # past the pieces' outputs


def test_rows_grouped_for_one_matmul_or_per_row():
    row_adapter = torch.tensor([0, 1, 0, -1] + [2] * SEGMENT_MIN_ROWS + [0] * 2)
    seg = segments_of(row_adapter)
    assert [(rows, a) for rows, a in seg.big] == [(slice(4, 4 + SEGMENT_MIN_ROWS), 2)]
    assert isinstance(seg.small_rows, torch.Tensor) and seg.small_adapter is not None
    got = list(zip(seg.small_rows.tolist(), seg.small_adapter.tolist(), strict=True))
    n = 4 + SEGMENT_MIN_ROWS
    assert got == [(0, 0), (1, 1), (2, 0), (n, 0), (n + 1, 0)]
    # decode rows first, then a long chunk: the per-row rows are one slice
    seg = segments_of(torch.tensor([1, 0, 1] + [2] * SEGMENT_MIN_ROWS + [-1]))
    assert seg.small_rows == slice(0, 3) and seg.small_adapter.tolist() == [1, 0, 1]
