"""The Triton LoRA products (`cadence.kernels.lora`) against their torch definitions
(`cadence.kernels.reference`), over adapters laid out as the KV pool holds them: rows of
one flat buffer read at several widths, scattered in shuffled order, every element
nothing was written to NaN and every padded index pointing at a NaN row, so a stray read
shows. Under
`TRITON_INTERPRET=1` (set by the conftest) without a GPU."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("triton")

from cadence.kernels.lora import RowPlan, lora_expand_, lora_shrink, plan_rows  # noqa: E402
from cadence.kernels.reference import lora_expand_ref_, lora_shrink_ref  # noqa: E402
from cadence.lora.products import ExpandTables, ShrinkTables  # noqa: E402
from kernel_cases import DEVICE, TOLERANCE, poisoned  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IN_FEATURES = 160  # 2½ shrink reduction steps
# a fused layer's pieces (q, k, v): output width and where it goes in y; columns 72..75
# and 140..147 belong to no piece and must stay as they are
PIECES = [(72, 0), (40, 76), (24, 116)]
Y_WIDTH = 148
# per adapter, its rank on each piece (the shrink's rank is their sum): 0, 4, 8, 16 and
# 64 per piece; adapter 2 leaves the layer alone
PIECE_RANKS = [[8, 0, 8], [4, 4, 4], [0, 0, 0], [64, 64, 0], [16, 16, 16]]
# (start, end, adapter) runs of the step's rows: a long prefill chunk over three segment
# tiles, decode rows, short runs, rows without an adapter (one run of them named, one
# not), a row of the adapter that leaves the layer alone
RUNS = [
    (0, 37, 3), (37, 38, 0), (38, 39, -1), (39, 44, 1), (44, 45, 4), (45, 47, 4),
    (47, 48, 2), (48, 52, -1), (52, 70, 0), (70, 71, 3),
]  # fmt: skip
SEGMENTS = [run for run in RUNS if run[0] != 38]  # row 38 is in no segment


class Pool:
    """A flat buffer of NaN, read as rows of any width as `cadence.lora.pool` lays
    adapters out; matrices go in row by row after random gaps, in shuffled order."""

    def __init__(self, dtype: torch.dtype, numel: int, g: torch.Generator) -> None:
        self.flat = torch.full((numel,), float("nan"), dtype=dtype)
        self.cursor = 0
        self.g = g

    def rows(self, width: int) -> torch.Tensor:
        return self.flat[: self.flat.numel() // width * width].view(-1, width)

    def put(self, matrix: torch.Tensor) -> torch.Tensor:
        """Stores matrix [r, w]; its rows' indices into `rows(w)`, in the matrix's order."""
        r, w = matrix.shape
        at = []
        for _ in range(r):
            i = -(-self.cursor // w) + int(torch.randint(0, 3, (), generator=self.g))
            at.append(i)
            self.cursor = (i + 1) * w
        assert self.cursor <= self.flat.numel(), "test pool too small"
        idx = torch.tensor(at, dtype=torch.int64)[torch.randperm(r, generator=self.g)]
        self.rows(w)[idx] = matrix.to(self.flat.dtype)
        return idx

    def garbage(self, width: int, n: int) -> torch.Tensor:
        """n indices of rows of `rows(width)` that nothing was written to (all NaN)."""
        last = self.rows(width).shape[0]
        first = -(-self.cursor // width)
        return torch.randint(first, last, (n,), generator=self.g)


@dataclass
class Layer:
    pool: Pool
    a_idx: torch.Tensor  # [A, Rmax]
    ranks: torch.Tensor  # [A]
    b_idx: list[torch.Tensor]  # per piece [A, rmax_piece]
    piece_ranks: list[torch.Tensor]  # per piece [A]
    rank_start: list[torch.Tensor]  # per piece [A]


def paged_layer(piece_ranks: list[list[int]], dtype: torch.dtype, seed: int) -> Layer:
    """Adapters of the given per-piece ranks, A and each piece's Bᵀ paged into one pool;
    index entries past a rank point at NaN rows."""
    g = torch.Generator().manual_seed(seed)
    pool = Pool(dtype, 1 << 19, g)
    stacked = [sum(r) for r in piece_ranks]
    rmax = max(stacked)
    a_idx = torch.zeros(len(piece_ranks), rmax, dtype=torch.int64)
    b_idx = [torch.zeros(len(piece_ranks), max(max(r[p] for r in piece_ranks), 1),
                         dtype=torch.int64) for p in range(len(PIECES))]  # fmt: skip
    starts = torch.zeros(len(PIECES), len(piece_ranks), dtype=torch.int64)
    for a, ranks in enumerate(piece_ranks):
        a_mat = torch.randn(stacked[a], IN_FEATURES, generator=g) * IN_FEATURES**-0.5
        a_idx[a, : stacked[a]] = pool.put(a_mat)
        first = 0
        for p, ((out, _), r) in enumerate(zip(PIECES, ranks, strict=True)):
            b_idx[p][a, :r] = pool.put(torch.randn(r, out, generator=g) * 0.1)
            starts[p, a] = first
            first += r
    # padding past each rank: rows nothing was written to
    for a, ranks in enumerate(piece_ranks):
        a_idx[a, stacked[a] :] = pool.garbage(IN_FEATURES, rmax - stacked[a])
        for p, ((out, _), r) in enumerate(zip(PIECES, ranks, strict=True)):
            b_idx[p][a, r:] = pool.garbage(out, b_idx[p].shape[1] - r)

    def dev(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=DEVICE, dtype=torch.int32)

    pool.flat = pool.flat.to(DEVICE)
    return Layer(
        pool,
        dev(a_idx),
        dev(torch.tensor(stacked)),
        [dev(b) for b in b_idx],
        [dev(torch.tensor([r[p] for r in piece_ranks])) for p in range(len(PIECES))],
        [dev(s) for s in starts],
    )


def step_rows(runs: list[tuple[int, int, int]]) -> torch.Tensor:
    row_adapter = torch.full((runs[-1][1],), -1, dtype=torch.int32)
    for start, end, adapter in runs:
        row_adapter[start:end] = adapter
    return row_adapter.to(DEVICE)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol, equal_nan=True)


def make_x(row_adapter: torch.Tensor, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """x as a view into a wider buffer; rows without an adapter NaN (they are never read)."""
    wide = torch.randn(row_adapter.shape[0], IN_FEATURES + 24, generator=g).to(dtype)
    x = wide.to(DEVICE)[:, 8 : 8 + IN_FEATURES]
    x[row_adapter < 0] = float("nan")
    return x


@pytest.mark.parametrize("launch", ["single rows", "segments"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_shrink_and_expand_match_reference(dtype: torch.dtype, launch: str) -> None:
    g = torch.Generator().manual_seed(7)
    layer = paged_layer(PIECE_RANKS, dtype, seed=3)
    row_adapter = step_rows(RUNS)
    rows = row_adapter.shape[0]
    segments = SEGMENTS if launch == "segments" else None
    x = make_x(row_adapter, dtype, g)
    rows_in = layer.pool.rows(IN_FEATURES)

    h_ref = lora_shrink_ref(x, ShrinkTables(rows_in, layer.a_idx, layer.ranks, row_adapter))
    h = poisoned(h_ref.shape, dtype)
    got = lora_shrink(
        x, ShrinkTables(rows_in, layer.a_idx, layer.ranks, row_adapter), segments, out=h
    )
    assert got is h
    assert h.isfinite().all(), "elements of h not written, or garbage read"
    close(h, h_ref, dtype)
    # past each row's rank, and on rows without an adapter, exactly zero
    ranks_of_rows = torch.where(row_adapter >= 0, layer.ranks[row_adapter.clamp(min=0)], 0)
    past = torch.arange(h.shape[1], device=DEVICE)[None, :] >= ranks_of_rows[:, None]
    assert (h[past] == 0).all()

    y0 = torch.randn(rows, Y_WIDTH, generator=g).to(dtype).to(DEVICE)
    y0[row_adapter < 0] = float("nan")  # never touched: NaN stays NaN
    y0[:, 72:76] = float("nan")
    y0[:, 140:] = float("nan")
    for _, offset in PIECES:  # left alone, not added 0 to (which gives +0.0)
        y0[:, offset : offset + 2] = -0.0
    y, y_ref = y0.clone(), y0.clone()
    for p, (out, offset) in enumerate(PIECES):
        args = (layer.pool.rows(out), layer.b_idx[p], layer.piece_ranks[p], layer.rank_start[p])
        lora_expand_(y, h_ref, ExpandTables(*args, offset, row_adapter), segments)
        lora_expand_ref_(y_ref, h_ref, ExpandTables(*args, offset, row_adapter))
    close(y, y_ref, dtype)
    assert torch.equal(y.isnan(), y0.isnan())
    # rows whose adapter leaves a piece alone keep that piece's bits
    for p, (out, offset) in enumerate(PIECES):
        alone = torch.where(row_adapter >= 0, layer.piece_ranks[p][row_adapter.clamp(min=0)], 0)
        cols = slice(offset, offset + out)
        assert torch.equal(bits(y[alone == 0, cols]), bits(y0[alone == 0, cols]))
    # and the adapted rows did change, on every piece their adapter has
    assert not torch.equal(y[row_adapter == 3][:, :116], y0[row_adapter == 3][:, :116])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_single_module_layer_at_every_rank(dtype: torch.dtype) -> None:
    """One piece over the whole output (o_proj-like), ranks 0/4/8/16/64, each adapter a
    run long enough for segment tiles and a decode row: single rows and a prebuilt row
    plan agree with the definition."""
    ranks = [[r, 0, 0] for r in (0, 4, 8, 16, 64)]
    layer = paged_layer(ranks, dtype, seed=11)
    runs = [(5 * a, 5 * a + 5, a) for a in range(5)] + [(25 + a, 26 + a, a) for a in range(5)]
    row_adapter = step_rows(runs)
    g = torch.Generator().manual_seed(1)
    x = make_x(row_adapter, dtype, g)
    rows_in = layer.pool.rows(IN_FEATURES)
    out = PIECES[0][0]
    args = (layer.pool.rows(out), layer.b_idx[0], layer.piece_ranks[0], layer.rank_start[0])
    h_ref = lora_shrink_ref(x, ShrinkTables(rows_in, layer.a_idx, layer.ranks, row_adapter))
    y0 = torch.randn(row_adapter.shape[0], out, generator=g).to(dtype).to(DEVICE)
    y_ref = y0.clone()
    lora_expand_ref_(y_ref, h_ref, ExpandTables(*args, 0, row_adapter))
    for segments in (None, plan_rows(row_adapter.shape[0], runs, DEVICE)):
        h = poisoned(h_ref.shape, dtype)
        lora_shrink(
            x, ShrinkTables(rows_in, layer.a_idx, layer.ranks, row_adapter), segments, out=h
        )
        close(h, h_ref, dtype)
        y = y0.clone()
        lora_expand_(y, h_ref, ExpandTables(*args, 0, row_adapter), segments)
        close(y, y_ref, dtype)


def test_rows_without_adapters_and_empty_steps() -> None:
    layer = paged_layer(PIECE_RANKS, torch.float32, seed=5)
    rows_in = layer.pool.rows(IN_FEATURES)
    none = torch.full((6,), -1, dtype=torch.int32, device=DEVICE)
    x = torch.full((6, IN_FEATURES), float("nan"), device=DEVICE)
    h = lora_shrink(x, ShrinkTables(rows_in, layer.a_idx, layer.ranks, none), [(0, 6, -1)])
    assert (h == 0).all()
    y = torch.full((6, 72), float("nan"), device=DEVICE)
    args = (layer.pool.rows(72), layer.b_idx[0], layer.piece_ranks[0], layer.rank_start[0])
    lora_expand_(y, h, ExpandTables(*args, 0, none))
    assert y.isnan().all()
    empty = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    h = lora_shrink(x[:0], ShrinkTables(rows_in, layer.a_idx, layer.ranks, empty))
    assert h.shape == (0, layer.a_idx.shape[1])
    lora_expand_(y[:0], h, ExpandTables(*args, 0, empty))


def test_plan_rows_partitions_the_step() -> None:
    plan = plan_rows(71, SEGMENTS, "cpu")
    assert isinstance(plan, RowPlan)
    tiles = plan.tiles.tolist() if plan.tiles is not None else []
    singles = plan.singles.tolist() if plan.singles is not None else []
    covered = sorted([r for s, e in tiles for r in range(s, e)] + singles)
    assert covered == list(range(71))
    # long runs in tiles of at most 16 rows, grouped by adapter (sorted); short runs and
    # the row in no segment alone
    assert tiles == [[48, 52], [52, 68], [68, 70], [39, 44], [0, 16], [16, 32], [32, 37]]
    assert sorted(singles) == [37, 38, 44, 45, 46, 47, 70]
    assert plan.num_singles == len(singles)
    assert plan_rows(5, None, "cpu").num_singles == 5


@pytest.mark.parametrize("bad", [[(0, 4, 0), (3, 6, 1)], [(2, 9, 0)], [(-1, 2, 0)]])
def test_plan_rows_refuses_overlapping_or_outside_segments(bad: list[tuple[int, int, int]]) -> None:
    with pytest.raises(ValueError, match="segment"):
        plan_rows(8, bad, "cpu")
