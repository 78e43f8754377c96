"""The per-step LoRA products over adapters paged into the KV pool (`cadence.lora.pool`),
for one LoRA layer and a step's token rows:

- `lora_shrink`: h[t, :R] = x[t] @ Aᵀ, A = R rows of `rows_in` picked by `a_idx[a]`;
- `lora_expand_`: y[t, out_offset :][: out] += h[t, s : s + r] @ Bᵀ, Bᵀ = r rows of
  `rows_out` picked by `b_idx[a]`;

a = `row_adapter[t]` (-1: no adapter, the row is left alone). The pool's rows are read in
place by index, never gathered into a copy, and an index past the adapter's rank is
never followed: its row may hold anything (another adapter, a quantized KV cache's bytes
read as floats, NaN), so those loads are masked rather than multiplied by zero.

Two launch shapes, each program reading an adapter's row tile once for the rows it
serves:
- segments (SGMV, prefill chunks): a program takes up to SEGMENT_TILE consecutive rows
  of one adapter and a tile of outputs, and multiplies the block of rows by each weight
  tile with `tl.dot`;
- single rows (BGMV, decode): a program takes one row and a tile of outputs, reading its
  own adapter's rows.
`plan_rows` splits a step's rows between them once per step, from the segments the
caller found (runs of consecutive rows sharing an adapter, sorted by adapter): runs of
MIN_SEGMENT_ROWS rows or more become segment tiles, every other row a single row.
Accumulation is float32; h comes out in x's dtype, y is summed in float32 and rounded
once. The torch definitions are `cadence.kernels.reference.lora_shrink_ref` and
`lora_expand_ref_`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from cadence.kernels import dot_in_f32
from cadence.lora.products import ExpandTables, ShrinkTables

SEGMENT_TILE = 16  # rows of one segment program (tl.dot's smallest M)
MIN_SEGMENT_ROWS = 4  # shorter runs gain little from a shared weight tile: single rows
SHRINK_BLOCK_K = 64  # input features per step of the shrink's reduction
EXPAND_BLOCK_N = 64  # output features per expand program
EXPAND_BLOCK_R = 16  # ranks per step of the expand's reduction


@dataclass(frozen=True, slots=True)
class RowPlan:
    """A step's rows split between the two launch shapes (built once per step by
    `plan_rows`, used by every LoRA layer). The tiles and the single rows partition the
    step's rows."""

    num_rows: int
    tiles: torch.Tensor | None  # int32 [n, 2]: (start, end), ≤ SEGMENT_TILE rows, one adapter
    singles: torch.Tensor | None  # int32 [m]: rows taken alone; None: every row, in order
    num_singles: int

    @property
    def num_tiles(self) -> int:
        return 0 if self.tiles is None else self.tiles.shape[0]


def plan_rows(
    num_rows: int,
    segments: Sequence[tuple[int, int, int]] | None,
    device: torch.device | str,
) -> RowPlan:
    """`segments`: (start, end, adapter) runs of rows [start, end) that share one adapter
    (row_adapter[start], which the kernels read); they must not overlap. Rows outside
    every run (rows without an adapter, say) need not be covered. None: every row is
    taken alone."""
    if segments is None:
        return RowPlan(num_rows, None, None, num_rows)
    uncovered: list[int] = []
    row = 0  # the first row after the runs seen, in row order
    for start, end, _ in sorted(segments):
        if not 0 <= start <= end <= num_rows:
            raise ValueError(f"segment [{start}, {end}) outside the step's {num_rows} rows")
        if start < row:
            raise ValueError(f"segment [{start}, {end}) overlaps another")
        uncovered += range(row, start)
        row = end
    uncovered += range(row, num_rows)
    tiles: list[tuple[int, int]] = []
    singles: list[int] = []
    for start, end, _ in sorted(segments, key=lambda s: s[2]):  # one adapter's tiles together
        if end - start >= MIN_SEGMENT_ROWS:
            tiles += [(s, min(s + SEGMENT_TILE, end)) for s in range(start, end, SEGMENT_TILE)]
        else:
            singles += range(start, end)
    singles += uncovered
    return RowPlan(
        num_rows,
        torch.tensor(tiles, dtype=torch.int32, device=device).view(-1, 2) if tiles else None,
        torch.tensor(singles, dtype=torch.int32, device=device) if singles else None,
        len(singles),
    )


@triton.jit
def _adapter_and_rank(adapter_ptr, row, ranks_ptr):
    """The row's adapter and that adapter's rank in `ranks_ptr` (0 without an adapter)."""
    a = tl.load(adapter_ptr + row).to(tl.int64)
    rank = tl.load(ranks_ptr + a, mask=a >= 0, other=0)
    return a, rank


@triton.jit
def _shrink_segment_kernel(
    x_ptr, rows_ptr, a_idx_ptr, ranks_ptr, adapter_ptr, tiles_ptr, h_ptr,
    in_features, rmax, stride_x, stride_rows, stride_a, stride_h,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    start = tl.load(tiles_ptr + 2 * tl.program_id(0))
    end = tl.load(tiles_ptr + 2 * tl.program_id(0) + 1)
    a, rank = _adapter_and_rank(adapter_ptr, start, ranks_ptr)
    m = start + tl.arange(0, BLOCK_M)
    m_ok = m < end
    m = m.to(tl.int64)
    j = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = j < rank
    idx = tl.load(a_idx_ptr + a * stride_a + j, mask=live, other=0).to(tl.int64)
    # a rank tile past the adapter's rank (or a row without one) reads nothing
    k_end = tl.where(tl.program_id(1) * BLOCK_R < rank, in_features, 0)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < in_features
        xt = tl.load(
            x_ptr + m[:, None] * stride_x + k[None, :],
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        )  # fmt: skip  [BLOCK_M, BLOCK_K]
        at = tl.load(
            rows_ptr + idx[None, :] * stride_rows + k[:, None],
            mask=live[None, :] & k_ok[:, None],
            other=0.0,
        )  # fmt: skip  [BLOCK_K, BLOCK_R]: Aᵀ
        if DOT_F32:
            acc += tl.dot(xt.to(tl.float32), at.to(tl.float32), input_precision=PRECISION)
        else:
            acc += tl.dot(xt, at, input_precision=PRECISION)
    tl.store(
        h_ptr + m[:, None] * stride_h + j[None, :],
        acc.to(h_ptr.dtype.element_ty),
        mask=m_ok[:, None] & (j < rmax)[None, :],
    )


@triton.jit
def _shrink_row_kernel(
    x_ptr, rows_ptr, a_idx_ptr, ranks_ptr, adapter_ptr, singles_ptr, h_ptr,
    in_features, rmax, stride_x, stride_rows, stride_a, stride_h,
    LISTED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    if LISTED:
        row = tl.load(singles_ptr + row)
    row = row.to(tl.int64)
    a, rank = _adapter_and_rank(adapter_ptr, row, ranks_ptr)
    j = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = j < rank
    idx = tl.load(a_idx_ptr + a * stride_a + j, mask=live, other=0).to(tl.int64)
    k_end = tl.where(tl.program_id(1) * BLOCK_R < rank, in_features, 0)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < in_features
        xv = tl.load(x_ptr + row * stride_x + k, mask=k_ok, other=0.0).to(tl.float32)
        at = tl.load(
            rows_ptr + idx[:, None] * stride_rows + k[None, :],
            mask=live[:, None] & k_ok[None, :],
            other=0.0,
        ).to(tl.float32)  # fmt: skip  [BLOCK_R, BLOCK_K]
        acc += tl.sum(at * xv[None, :], axis=1)
    tl.store(h_ptr + row * stride_h + j, acc.to(h_ptr.dtype.element_ty), mask=j < rmax)


@triton.jit
def _expand_segment_kernel(
    y_ptr, h_ptr, rows_ptr, b_idx_ptr, ranks_ptr, rank_start_ptr, adapter_ptr, tiles_ptr,
    out_features, out_offset, stride_y, stride_h, stride_rows, stride_b,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    start = tl.load(tiles_ptr + 2 * tl.program_id(0))
    end = tl.load(tiles_ptr + 2 * tl.program_id(0) + 1)
    a, rank = _adapter_and_rank(adapter_ptr, start, ranks_ptr)
    if rank == 0:  # no adapter, or one that leaves this piece alone: y untouched
        return
    first = tl.load(rank_start_ptr + a)
    m = start + tl.arange(0, BLOCK_M)
    m_ok = m < end
    m = m.to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < out_features
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j0 in range(0, rank, BLOCK_R):
        j = j0 + tl.arange(0, BLOCK_R)
        live = j < rank
        idx = tl.load(b_idx_ptr + a * stride_b + j, mask=live, other=0).to(tl.int64)
        ht = tl.load(
            h_ptr + m[:, None] * stride_h + (first + j)[None, :],
            mask=m_ok[:, None] & live[None, :],
            other=0.0,
        )  # fmt: skip  [BLOCK_M, BLOCK_R]
        bt = tl.load(
            rows_ptr + idx[:, None] * stride_rows + n[None, :],
            mask=live[:, None] & n_ok[None, :],
            other=0.0,
        )  # fmt: skip  [BLOCK_R, BLOCK_N]: Bᵀ
        if DOT_F32:
            acc += tl.dot(ht.to(tl.float32), bt.to(tl.float32), input_precision=PRECISION)
        else:
            acc += tl.dot(ht, bt, input_precision=PRECISION)
    dst = y_ptr + m[:, None] * stride_y + out_offset + n[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    y = tl.load(dst, mask=ok, other=0.0).to(tl.float32) + acc
    tl.store(dst, y.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _expand_row_kernel(
    y_ptr, h_ptr, rows_ptr, b_idx_ptr, ranks_ptr, rank_start_ptr, adapter_ptr, singles_ptr,
    out_features, out_offset, stride_y, stride_h, stride_rows, stride_b,
    LISTED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    if LISTED:
        row = tl.load(singles_ptr + row)
    row = row.to(tl.int64)
    a, rank = _adapter_and_rank(adapter_ptr, row, ranks_ptr)
    if rank == 0:
        return
    first = tl.load(rank_start_ptr + a)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < out_features
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j0 in range(0, rank, BLOCK_R):
        j = j0 + tl.arange(0, BLOCK_R)
        live = j < rank
        idx = tl.load(b_idx_ptr + a * stride_b + j, mask=live, other=0).to(tl.int64)
        hv = tl.load(h_ptr + row * stride_h + first + j, mask=live, other=0.0).to(tl.float32)
        bt = tl.load(
            rows_ptr + idx[:, None] * stride_rows + n[None, :],
            mask=live[:, None] & n_ok[None, :],
            other=0.0,
        ).to(tl.float32)  # fmt: skip  [BLOCK_R, BLOCK_N]
        acc += tl.sum(hv[:, None] * bt, axis=0)
    dst = y_ptr + row * stride_y + out_offset + n
    y = tl.load(dst, mask=n_ok, other=0.0).to(tl.float32) + acc
    tl.store(dst, y.to(y_ptr.dtype.element_ty), mask=n_ok)


def _plan(
    segments: RowPlan | Sequence[tuple[int, int, int]] | None, rows: int, device: torch.device
) -> RowPlan:
    if isinstance(segments, RowPlan):
        if segments.num_rows != rows:
            raise ValueError(f"row plan for {segments.num_rows} rows, step has {rows}")
        return segments
    return plan_rows(rows, segments, device)


def _dot_args(dtype: torch.dtype) -> dict[str, object]:
    # float32 products in float32, not TF32: the same sums as the torch definition
    return {"DOT_F32": dot_in_f32(dtype), "PRECISION": "ieee" if dtype == torch.float32 else "tf32"}


def _check_rows(name: str, t: torch.Tensor, width: int, dtype: torch.dtype) -> None:
    if t.dim() != 2 or t.shape[1] != width or t.stride(1) != 1:
        raise ValueError(f"{name}: want a row-major [*, {width}] view, got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise ValueError(f"{name}: dtype {t.dtype}, the step computes in {dtype}")


def lora_shrink(
    x: torch.Tensor,
    t: ShrinkTables,
    segments: RowPlan | Sequence[tuple[int, int, int]] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, in], `t` (the pool's rows [N, in], a_idx int32 [A, Rmax], ranks int32 [A],
    row_adapter int32 [T]) -> h [T, Rmax] in x's dtype (into `out` when given; every
    element is written). `segments`: a `RowPlan`, or the (start, end, adapter) runs to
    build one from; None takes every row alone."""
    rows_in, a_idx, ranks, row_adapter = t.rows_in, t.a_idx, t.ranks, t.row_adapter
    rows, in_features = x.shape
    rmax = a_idx.shape[1]
    _check_rows("x", x, in_features, x.dtype)
    _check_rows("rows_in", rows_in, in_features, x.dtype)
    h = torch.empty(rows, rmax, dtype=x.dtype, device=x.device) if out is None else out
    _check_rows("out", h, rmax, x.dtype)
    if h.shape[0] != rows:
        raise ValueError(f"out has {h.shape[0]} rows, x {rows}")
    if rows == 0 or rmax == 0:
        return h
    plan = _plan(segments, rows, x.device)
    block_r = max(16, min(64, triton.next_power_of_2(rmax)))
    common = (in_features, rmax, x.stride(0), rows_in.stride(0), a_idx.stride(0), h.stride(0))
    if plan.num_tiles:
        _shrink_segment_kernel[(plan.num_tiles, triton.cdiv(rmax, block_r))](
            x, rows_in, a_idx, ranks, row_adapter, plan.tiles, h, *common,
            BLOCK_M=SEGMENT_TILE, BLOCK_R=block_r, BLOCK_K=SHRINK_BLOCK_K, **_dot_args(x.dtype),
        )  # fmt: skip
    if plan.num_singles:
        listed = plan.singles is not None
        _shrink_row_kernel[(plan.num_singles, triton.cdiv(rmax, block_r))](
            x, rows_in, a_idx, ranks, row_adapter, plan.singles if listed else row_adapter, h,
            *common, LISTED=listed, BLOCK_R=block_r, BLOCK_K=SHRINK_BLOCK_K,
        )  # fmt: skip
    return h


def lora_expand_(
    y: torch.Tensor,
    h: torch.Tensor,
    t: ExpandTables,
    segments: RowPlan | Sequence[tuple[int, int, int]] | None = None,
) -> None:
    """In place: y [T, out_total] gets, on columns [out_offset, out_offset + out), h [T,
    Rmax]'s columns [rank_start[a], + piece_ranks[a]) times the piece's Bᵀ, the rows of
    rows_out [N, out] listed in b_idx int32 [A, rmax_piece] (`t`). Rows without an
    adapter, or whose adapter's piece rank is 0, are not touched."""
    rows_out, b_idx, out_offset, row_adapter = t.rows_out, t.b_idx, t.out_offset, t.row_adapter
    piece_ranks, rank_start = t.piece_ranks, t.rank_start
    rows, out_features = h.shape[0], rows_out.shape[1]
    _check_rows("y", y, y.shape[1], y.dtype)
    _check_rows("h", h, h.shape[1], y.dtype)
    _check_rows("rows_out", rows_out, out_features, y.dtype)
    if y.shape[0] != rows or not 0 <= out_offset <= y.shape[1] - out_features:
        raise ValueError(
            f"y {tuple(y.shape)} cannot take [{rows}, {out_features}] at column {out_offset}"
        )
    if rows == 0 or out_features == 0 or b_idx.shape[1] == 0:
        return
    plan = _plan(segments, rows, y.device)
    tiles_n = triton.cdiv(out_features, EXPAND_BLOCK_N)
    common = (
        out_features, out_offset, y.stride(0), h.stride(0), rows_out.stride(0), b_idx.stride(0)
    )  # fmt: skip
    weights = (y, h, rows_out, b_idx, piece_ranks, rank_start, row_adapter)
    if plan.num_tiles:
        _expand_segment_kernel[(plan.num_tiles, tiles_n)](
            *weights, plan.tiles, *common, BLOCK_M=SEGMENT_TILE, BLOCK_N=EXPAND_BLOCK_N,
            BLOCK_R=EXPAND_BLOCK_R, **_dot_args(y.dtype),
        )  # fmt: skip
    if plan.num_singles:
        listed = plan.singles is not None
        _expand_row_kernel[(plan.num_singles, tiles_n)](
            *weights, plan.singles if listed else row_adapter, *common,
            LISTED=listed, BLOCK_N=EXPAND_BLOCK_N, BLOCK_R=EXPAND_BLOCK_R,
        )  # fmt: skip
