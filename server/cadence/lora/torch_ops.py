"""The LoRA products of one layer over a step's rows, in torch (any device; the CPU's
path). Rows are the forward's token rows; `row_adapter[t]` is row t's index into the
step's adapter list (-1: none, the row is left alone).

An adapter's rows that are many (a prefill chunk) take one gather of its matrices and a
matmul (`Segments.big`); the others (decode rows of many adapters) one batched gather of
each row's matrices and a `bmm` (`Segments.small_*`), or with `cpu_kernels` on CPU one
C++ call that reads each row's matrices in place in the pool (`cadence.lora.cpu_rows`).
Products accumulate in float32 (inside torch's kernels for bfloat16): h comes out in x's
dtype, and the expand's delta is added to y in float32 and rounded once (as
`cadence.kernels.lora` does on CUDA).

Every index in `a_idx` / `b_idx` must name a row of finite numbers, padding and adapters
of rank 0 included (`cadence.lora.batch` points those at another adapter's rows): the
pool's other rows are KV bytes read as the compute dtype, possibly NaN, and masking
multiplies nothing by them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cadence.lora import cpu_rows
from cadence.lora.products import ExpandTables, ShrinkTables

SEGMENT_MIN_ROWS = 8  # an adapter's rows from which they take the gather + matmul path

Rows = slice | torch.Tensor


@dataclass(frozen=True, slots=True)
class Segments:
    """A step's rows grouped by adapter: the big groups (rows, adapter index) one by one,
    the rest row by row."""

    big: tuple[tuple[Rows, int], ...]
    small_rows: Rows | None  # [n] long, or a slice when they are consecutive
    small_adapter: torch.Tensor | None  # [n] long: their adapters


def group_rows(
    runs: list[tuple[int, int, int]],
    device: torch.device | str = "cpu",
    min_rows: int = SEGMENT_MIN_ROWS,
) -> Segments:
    """Segments from runs (start, count, adapter) of consecutive rows of one adapter (a
    request's rows; adapter -1 runs are skipped); an adapter's rows make a big segment
    from `min_rows` on."""
    by_adapter: dict[int, list[tuple[int, int]]] = {}
    for start, count, a in runs:
        if a >= 0 and count > 0:
            by_adapter.setdefault(a, []).append((start, count))
    big: list[tuple[Rows, int]] = []
    small: list[tuple[int, int, int]] = []
    for a, spans in by_adapter.items():
        if sum(n for _, n in spans) < min_rows:
            small += [(s, n, a) for s, n in spans]
        elif len(spans) == 1:
            s, n = spans[0]
            big.append((slice(s, s + n), a))
        else:
            rows = torch.cat([torch.arange(s, s + n) for s, n in spans]).to(device)
            big.append((rows, a))
    if not small:
        return Segments(tuple(big), None, None)
    small.sort()
    counts = torch.tensor([n for _, n, _ in small])
    adapters = torch.repeat_interleave(torch.tensor([a for _, _, a in small]), counts)
    first, last = small[0][0], small[-1][0] + small[-1][1]
    if last - first == sum(n for _, n, _ in small):  # one run of rows (decode rows, say)
        return Segments(tuple(big), slice(first, last), adapters.to(device))
    small_rows = torch.cat([torch.arange(s, s + n) for s, n, _ in small])
    return Segments(tuple(big), small_rows.to(device), adapters.to(device))


def segments_of(row_adapter: torch.Tensor) -> Segments:
    """Segments from the rows' adapters alone (its runs of equal adapters)."""
    values = row_adapter.tolist()
    runs: list[tuple[int, int, int]] = []
    for t, a in enumerate(values):
        if runs and runs[-1][2] == a and runs[-1][0] + runs[-1][1] == t:
            s, n, _ = runs[-1]
            runs[-1] = (s, n + 1, a)
        else:
            runs.append((t, 1, a))
    return group_rows(runs, row_adapter.device)


def lora_shrink(
    x: torch.Tensor,
    t: ShrinkTables,
    segments: Segments | None = None,
    cpu_kernels: bool = False,
) -> torch.Tensor:
    """h [T, Rmax] in x's dtype (`ShrinkTables`), 0 past each row's rank and on rows
    without an adapter. `cpu_kernels`: the small rows through the C++ kernels where they
    take the tensors."""
    rows_in, a_idx, ranks = t.rows_in, t.a_idx, t.ranks
    seg = segments if segments is not None else segments_of(t.row_adapter)
    rmax = a_idx.shape[1]
    h = x.new_zeros(x.shape[0], rmax)
    if seg.big:
        rank = ranks.tolist()
        for rows, a in seg.big:
            r = rank[a]
            if r:
                h[rows, :r] = _take(x, rows) @ _gather(rows_in, a_idx[a, :r]).T
    if seg.small_rows is not None and seg.small_adapter is not None:
        rows, adapters = seg.small_rows, seg.small_adapter
        if cpu_kernels and cpu_rows.fits(x, rows_in, h):
            cpu_rows.shrink_rows_(h, x, t, rows, adapters)
            return h
        a_mats = _gather(rows_in, a_idx[adapters])  # [n, Rmax, in]
        hs = torch.bmm(a_mats, _take(x, rows).unsqueeze(2)).squeeze(2)
        keep = torch.arange(rmax, device=x.device) < ranks[adapters].unsqueeze(1)
        h[rows] = torch.where(keep, hs, 0)
    return h


def lora_expand_(
    y: torch.Tensor,
    h: torch.Tensor,
    t: ExpandTables,
    segments: Segments | None = None,
    cpu_kernels: bool = False,
) -> None:
    """In place: y += one output piece's delta (`ExpandTables`) on the rows with an
    adapter. `cpu_kernels`: the small rows through the C++ kernels where they take the
    tensors."""
    rows_out, b_idx, piece_ranks, rank_start = t.rows_out, t.b_idx, t.piece_ranks, t.rank_start
    seg = segments if segments is not None else segments_of(t.row_adapter)
    target = y.narrow(1, t.out_offset, rows_out.shape[1])
    if seg.big:
        rank, start = piece_ranks.tolist(), rank_start.tolist()
        for rows, a in seg.big:
            r, s = rank[a], start[a]
            if not r:
                continue
            b_mat = _gather(rows_out, b_idx[a, :r])
            _add_(target, rows, _f32(_take(h, rows)[:, s : s + r]) @ _f32(b_mat))
    if seg.small_rows is not None and seg.small_adapter is not None:
        rows, adapters = seg.small_rows, seg.small_adapter
        if cpu_kernels and cpu_rows.fits(y, h, rows_out):
            cpu_rows.expand_rows_(y, h, t, rows, adapters)
            return
        rp = b_idx.shape[1]
        j = torch.arange(rp, device=h.device)
        cols = (rank_start[adapters].unsqueeze(1) + j).clamp(max=h.shape[1] - 1)
        keep = j < piece_ranks[adapters].unsqueeze(1)
        hp = torch.where(keep, _take(h, rows).gather(1, cols), 0)  # [n, rp]
        b_mats = _f32(_gather(rows_out, b_idx[adapters]))  # [n, rp, out]
        _add_(target, rows, torch.bmm(_f32(hp).unsqueeze(1), b_mats).squeeze(1))


def _gather(pool_rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """pool_rows[index] ([*index.shape, width]) through index_select: several times
    faster on CPU than advanced indexing with a 2-d index."""
    return pool_rows.index_select(0, index.reshape(-1)).view(*index.shape, pool_rows.shape[1])


def _take(t: torch.Tensor, rows: Rows) -> torch.Tensor:
    return t[rows] if isinstance(rows, slice) else t.index_select(0, rows)


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


def _add_(target: torch.Tensor, rows: Rows, delta: torch.Tensor) -> None:
    """target[rows] += delta (float32), rounded once to target's dtype; `rows` distinct."""
    if target.dtype == torch.float32:
        if isinstance(rows, slice):
            target[rows] += delta
        else:
            target.index_add_(0, rows, delta)
    else:
        target[rows] = (target[rows].float() + delta).to(target.dtype)
