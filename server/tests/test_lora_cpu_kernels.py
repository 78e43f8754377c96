"""The C++ LoRA row kernels (`torch.ops.cadence.lora_shrink_rows_` / `lora_expand_rows_`,
`cadence/kernels/cpu/lora_kernels.cpp`) on every instruction set this CPU runs: against
the dense definitions (`cadence.kernels.reference`) over adapters of ranks 0, 4, 8, 16 and
64 with pieces that start past rank 0 and land at an offset, rows of no adapter, and row
selections that are an index or a run; every row they must not touch, every pool row no
adapter names and every padding index NaN, so a stray read or write shows. Then through
`cadence.lora.torch_ops` against its torch path, the shape and index checks, and an
engine's mixed-adapter run with the kernels on and off. (`server/tests/kernels/test_cpu_ops.py`
runs `torch.library.opcheck` on both, the Meta implementations among what it checks.)"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from cadence.kernels import cpu
from cadence.kernels.reference import lora_expand_ref_, lora_shrink_ref
from cadence.lora.products import ExpandTables, ShrinkTables
from cadence.lora.torch_ops import group_rows, lora_expand_, lora_shrink
from lora_script import REQUESTS, mixed_run

if not cpu.available():
    pytest.skip(f"no CPU kernels: {cpu.unavailable_reason()}", allow_module_level=True)

OPS = torch.ops.cadence
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
IN = 160  # five 32-element steps of the bfloat16 dot products, no tail
IN_TAIL = 100  # a masked tail
# (out, out_offset) of each piece in y; columns 72..75 and 140..147 belong to none
PIECES = [(72, 0), (40, 76), (24, 116)]
Y_WIDTH = 148
# per adapter its rank on each piece (the shrink's rank is their sum, at most 128);
# adapter 2 leaves the layer alone
PIECE_RANKS = [[8, 0, 8], [4, 4, 4], [0, 0, 0], [64, 64, 0], [16, 16, 16]]
POOL_ROWS = 1200
# the step's rows' adapters (-1: none); the kernels cover SELECTED (an index, in no order
# the rows are in) or RUN (rows 3..13), the others must stay as they were
ROW_ADAPTER = [0, 1, -1, 3, 4, 4, 2, -1, 0, 3, 1, 4, 0, -1, 2, 1]
SELECTED = [12, 0, 3, 5, 6, 7, 9, 10, 14, 2]
RUN = slice(3, 14)


@dataclass
class Layer:
    """A layer's tables over a pool: A rows (rows_in) and per piece Bᵀ rows (rows_out), at
    shuffled rows of the pools; with `poison` every other row is NaN and padding past each
    rank names one."""

    rows_in: torch.Tensor
    a_idx: torch.Tensor
    ranks: torch.Tensor
    pieces: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]


def _table(ranks: list[int], g: torch.Generator, pool: torch.Tensor, poison: bool):
    """Row indices [A, max rank] of distinct random rows (filled with values), padded past
    each rank with a NaN row (poison) or its last real row."""
    width = max(max(ranks), 1)
    free = torch.randperm(POOL_ROWS - 1, generator=g) + 1  # row 0 stays NaN
    idx = torch.zeros(len(ranks), width, dtype=torch.long)
    taken = 0
    for a, r in enumerate(ranks):
        real = free[taken : taken + r]
        taken += r
        pool[real] = torch.randn(r, pool.shape[1], generator=g).to(pool.dtype)
        pad = torch.zeros(1, dtype=torch.long) if poison or r == 0 else real[-1:]
        idx[a] = torch.cat([real, pad.expand(width - r)])
    return idx


def _pool(rows: int, width: int, dtype: torch.dtype, g: torch.Generator, poison: bool):
    """A pool of NaN rows (poison), else of random ones."""
    if poison:
        return torch.full((rows, width), float("nan"), dtype=dtype)
    return torch.randn(rows, width, generator=g).to(dtype)


def layer(dtype: torch.dtype, g: torch.Generator, poison: bool = True, width: int = IN) -> Layer:
    ranks = [sum(r) for r in PIECE_RANKS]
    rows_in = _pool(POOL_ROWS, width, dtype, g, poison)
    a_idx = _table(ranks, g, rows_in, poison)
    pieces = []
    for p, (out, offset) in enumerate(PIECES):
        piece_ranks = [r[p] for r in PIECE_RANKS]
        rows_out = _pool(POOL_ROWS, out, dtype, g, poison)
        b_idx = _table(piece_ranks, g, rows_out, poison)
        rank_start = torch.tensor([sum(r[:p]) for r in PIECE_RANKS])
        pieces.append((offset, rows_out, b_idx, torch.tensor(piece_ranks), rank_start))
    return Layer(rows_in, a_idx, torch.tensor(ranks), pieces)


def _selection(kind: str) -> tuple[list[int], torch.Tensor | None, int]:
    """(the covered rows, the operators' rows argument, first_row)."""
    if kind == "index":
        return SELECTED, torch.tensor(SELECTED), 0
    return list(range(RUN.start, RUN.stop)), None, RUN.start


def _only(rows: list[int]) -> torch.Tensor:
    """The step's row_adapter with every row outside `rows` made -1 (what the reference
    then leaves alone)."""
    keep = torch.full((len(ROW_ADAPTER),), -1)
    keep[rows] = torch.tensor(ROW_ADAPTER)[rows]
    return keep


def _assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """Close to the dtype's rounding, relative to the largest value (sums of up to 128
    products, in another order than the reference's, differ by that much near zero)."""
    tol = TOLERANCE[dtype]
    scale = float(want.float().nan_to_num(0.0).abs().max())
    torch.testing.assert_close(
        got.float(), want.float(), atol=tol * scale, rtol=tol, equal_nan=True
    )


@pytest.mark.usefixtures("cpu_isa")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["index", "run"])
@pytest.mark.parametrize("width", [IN, IN_TAIL])
def test_row_kernels_match_the_reference(dtype, kind, width):
    g = torch.Generator().manual_seed(1)
    t = layer(dtype, g, width=width)
    rows, index, first = _selection(kind)
    adapters = torch.tensor(ROW_ADAPTER)[rows]
    x = torch.randn(len(ROW_ADAPTER), width, generator=g).to(dtype)
    x[7] = float("nan")  # a row of no adapter: its h is 0 without reading it
    rmax = t.a_idx.shape[1]

    h = torch.full((len(ROW_ADAPTER), rmax), float("nan"), dtype=dtype)
    OPS.lora_shrink_rows_(x, t.rows_in, t.a_idx, t.ranks, adapters, index, first, h)
    want = lora_shrink_ref(x, ShrinkTables(t.rows_in, t.a_idx, t.ranks, _only(rows)))
    others = [r for r in range(len(ROW_ADAPTER)) if r not in rows]
    assert h[others].isnan().all()  # rows outside the selection untouched
    _assert_close(h[rows], want[rows], dtype)
    assert not h[rows].isnan().any()

    y0 = torch.randn(len(ROW_ADAPTER), Y_WIDTH, generator=g).to(dtype)
    y, y_ref = y0.clone(), y0.clone()
    h_in = h.nan_to_num(0.0)
    for offset, rows_out, b_idx, piece_ranks, rank_start in t.pieces:
        OPS.lora_expand_rows_(
            y, h_in, rows_out, b_idx, piece_ranks, rank_start, offset, adapters, index, first
        )
        expand = ExpandTables(rows_out, b_idx, piece_ranks, rank_start, offset, _only(rows))
        lora_expand_ref_(y_ref, h_in, expand)
    assert torch.equal(y[others], y0[others])
    assert torch.equal(y[:, 72:76], y0[:, 72:76]) and torch.equal(y[:, 140:], y0[:, 140:])
    _assert_close(y, y_ref, dtype)
    assert not y.isnan().any()
    changed = (y.float() - y0.float()).abs().amax(dim=1)
    for r in rows:  # every row of an adapter touching the layer got its delta
        assert (changed[r] > 0) == (ROW_ADAPTER[r] >= 0 and ROW_ADAPTER[r] != 2), r


@pytest.mark.usefixtures("cpu_isa")
@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_ops_through_the_kernels_match_its_torch_path(dtype):
    """cadence.lora.torch_ops with cpu_kernels against itself without, over a step's rows
    as one run (decode rows), scattered (short chunks apart) and beside a big segment
    (adapter 3's long chunk, which keeps the matmul); the padding here names real rows, as
    the torch path needs."""
    g = torch.Generator().manual_seed(2)
    t = layer(dtype, g, poison=False)
    runs = [(0, 1, 0), (1, 1, 1), (2, 1, 4), (3, 12, 3), (15, 1, -1), (16, 3, 1), (19, 2, -1)]
    row_adapter = torch.tensor([a for _, n, a in runs for _ in range(n)])
    x = torch.randn(len(row_adapter), IN, generator=g).to(dtype)
    y0 = torch.randn(len(row_adapter), Y_WIDTH, generator=g).to(dtype)
    by_kind = {
        "run": group_rows(runs[:3]),
        "rows and a segment": group_rows(runs, min_rows=8),
        "rows": group_rows(runs, min_rows=256),
    }
    assert isinstance(by_kind["run"].small_rows, slice)
    assert by_kind["rows and a segment"].big and not by_kind["rows"].big
    for segments in by_kind.values():
        got, want = y0.clone(), y0.clone()
        for y, on in ((got, True), (want, False)):
            h = lora_shrink(x, ShrinkTables(t.rows_in, t.a_idx, t.ranks, row_adapter), segments, on)
            for offset, rows_out, b_idx, piece_ranks, rank_start in t.pieces:
                expand = ExpandTables(rows_out, b_idx, piece_ranks, rank_start, offset, row_adapter)
                lora_expand_(y, h, expand, segments, on)
        _assert_close(got, want, dtype)
        assert not torch.equal(got, y0)


def _args(dtype: torch.dtype = torch.float32):
    t = layer(dtype, torch.Generator().manual_seed(3))
    offset, rows_out, b_idx, piece_ranks, rank_start = t.pieces[0]
    adapters = torch.tensor(ROW_ADAPTER)
    x = torch.randn(len(ROW_ADAPTER), IN).to(dtype)
    h = torch.zeros(len(ROW_ADAPTER), t.a_idx.shape[1], dtype=dtype)
    y = torch.zeros(len(ROW_ADAPTER), Y_WIDTH, dtype=dtype)
    shrink = [x, t.rows_in, t.a_idx, t.ranks, adapters, None, 0, h]
    expand = [y, h, rows_out, b_idx, piece_ranks, rank_start, offset, adapters, None, 0]
    return shrink, expand


def _with(args: list, at: int, value) -> list:
    changed = list(args)
    changed[at] = value
    return changed


def test_indices_out_of_the_pool_are_errors_naming_them():
    shrink, expand = _args()
    a_idx, ranks = shrink[2], shrink[3]
    past = a_idx.clone()
    past[3, 5] = POOL_ROWS  # adapter 3 has rank 128: index 5 is read
    with pytest.raises(IndexError, match=r"a_idx\[3, 5\] = 1200 is out of range.*rows_in"):
        OPS.lora_shrink_rows_(*_with(shrink, 2, past))
    negative = a_idx.clone()
    negative[0, 0] = -1
    with pytest.raises(IndexError, match=r"a_idx\[0, 0\] = -1"):
        OPS.lora_shrink_rows_(*_with(shrink, 2, negative))
    unread = a_idx.clone()
    unread[0, 100] = 10**9  # past adapter 0's rank 16: never read, so no error
    OPS.lora_shrink_rows_(*_with(shrink, 2, unread))
    too_high = ranks.clone()
    too_high[1] = a_idx.shape[1] + 1
    with pytest.raises(IndexError, match=r"ranks\[1\] = 129"):
        OPS.lora_shrink_rows_(*_with(shrink, 3, too_high))
    with pytest.raises(IndexError, match=r"row_adapter\[0\] = 5"):
        OPS.lora_shrink_rows_(*_with(shrink, 4, torch.tensor([5] + ROW_ADAPTER[1:])))
    with pytest.raises(IndexError, match=r"rows\[1\] = 16"):
        OPS.lora_shrink_rows_(
            *_with(_with(shrink, 4, torch.tensor([0, 1])), 5, torch.tensor([0, 16]))
        )
    with pytest.raises(ValueError, match="first_row 1 \\+ 16 rows"):
        OPS.lora_shrink_rows_(*_with(shrink, 6, 1))

    b_idx, rank_start = expand[3], expand[5]
    past = b_idx.clone()
    past[4, 15] = POOL_ROWS + 7
    with pytest.raises(IndexError, match=r"b_idx\[4, 15\] = 1207 .*rows_out"):
        OPS.lora_expand_rows_(*_with(expand, 3, past))
    late = rank_start.clone()
    late[3] = expand[1].shape[1] - 63  # 64 ranks from there run past h
    with pytest.raises(IndexError, match=r"rank_start\[3\]"):
        OPS.lora_expand_rows_(*_with(expand, 5, late))
    with pytest.raises(ValueError, match="out_offset 100"):
        OPS.lora_expand_rows_(*_with(expand, 6, 100))


def test_shapes_and_dtypes_are_checked_before_the_kernel():
    shrink, expand = _args()
    with pytest.raises(ValueError, match="rows_in must be torch.float32 \\[rows, 160\\]"):
        OPS.lora_shrink_rows_(*_with(shrink, 1, shrink[1].to(torch.bfloat16)))
    with pytest.raises(ValueError, match="rows_in .*each row packed"):
        OPS.lora_shrink_rows_(*_with(shrink, 1, torch.zeros(IN, 50).T))
    with pytest.raises(ValueError, match="h must be a contiguous torch.float32 \\[16, 128\\]"):
        OPS.lora_shrink_rows_(*_with(shrink, 7, torch.zeros(16, 8)))
    with pytest.raises(ValueError, match="a_idx must be int64 or int32"):
        OPS.lora_shrink_rows_(*_with(shrink, 2, shrink[2].float()))
    with pytest.raises(ValueError, match="ranks must be int64 or int32 \\[5\\]"):
        OPS.lora_shrink_rows_(*_with(shrink, 3, torch.tensor([1, 2])))
    with pytest.raises(ValueError, match="y must be .*each row packed"):
        OPS.lora_expand_rows_(*_with(expand, 0, torch.zeros(Y_WIDTH, 16).T))
    with pytest.raises(ValueError, match="h must be torch.float32 \\[16, rank\\]"):
        OPS.lora_expand_rows_(*_with(expand, 1, expand[1][:4]))


def test_int32_tables_give_the_int64_results():
    shrink, _ = _args()
    OPS.lora_shrink_rows_(*shrink)
    want, got = shrink[7], torch.zeros_like(shrink[7])
    narrow = [
        a.int() if isinstance(a, torch.Tensor) and a.dtype == torch.long else a for a in shrink
    ]
    OPS.lora_shrink_rows_(*_with(narrow, 7, got))
    assert torch.equal(got, want) and want.abs().sum() > 0


def test_an_engine_serves_mixed_adapters_alike_with_the_kernels_on_and_off(model_dirs, engine_for):
    engine = engine_for(model_dirs("llama_gqa"))
    assert engine.adapters.context.cpu_kernels  # on by default on CPU
    got, _ = mixed_run(engine, with_adapters=True)
    engine = engine_for(model_dirs("llama_gqa"))
    engine.adapters.context.cpu_kernels = False
    want, _ = mixed_run(engine, with_adapters=True)
    for rid in REQUESTS:
        torch.testing.assert_close(got[rid], want[rid], atol=1e-4, rtol=0, msg=f"request {rid}")
