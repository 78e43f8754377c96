"""The small-rows LoRA products through the C++ CPU kernels (`torch.ops.cadence.
lora_shrink_rows_` / `lora_expand_rows_`, `cadence/kernels/cpu/lora_kernels.cpp`): each row
reads its adapter's rows in place in the pool, one call per layer for the shrink and one
per output piece, where torch's path gathers every row's matrices into a copy first
(`cadence.lora.torch_ops`, which calls these when `fits`).

Rows are `Segments.small_rows` (an index tensor, or a slice when consecutive) with their
adapters `Segments.small_adapter`.
"""

from __future__ import annotations

import torch

from cadence.kernels import cpu as cpu_kernels
from cadence.lora.products import ExpandTables, ShrinkTables

Rows = slice | torch.Tensor

# An adapter's rows from which they take torch's gather + matmul instead (`Segments.big`)
# when these kernels serve: reading the adapter's rows in place, once per row but from the
# cache after the first, beat the matmul up to 512 rows of one rank-16 adapter (q + v
# pieces, SmolLM2's widths, one thread: bfloat16 with AVX-512 BF16 79 against 187 us at
# 256 rows, 142 against 309 at 512; float32 held to AVX2 125 against 146 at 256, 235
# against 258 at 512). Longer prefill chunks keep the matmul, which oneDNN spreads over
# the threads.
SEGMENT_MIN_ROWS = 256

_cadence = torch.ops.cadence  # the operators exist once the kernels are selected


def fits(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these tensors (x or y, h, the pool's rows): CPU tensors of
    one dtype the kernels are built for, the kernels selected."""
    dtype = tensors[0].dtype
    return (
        dtype in cpu_kernels.DTYPES
        and cpu_kernels.selected_isa() is not None
        and all(t.device.type == "cpu" and t.dtype == dtype for t in tensors)
    )


def _selection(rows: Rows) -> tuple[torch.Tensor | None, int]:
    """(rows, first_row) as the operators take them: an index, or a run from first_row."""
    if isinstance(rows, slice):
        return None, rows.start or 0
    return rows, 0


def shrink_rows_(
    h: torch.Tensor, x: torch.Tensor, t: ShrinkTables, rows: Rows, adapters: torch.Tensor
) -> None:
    """h[r] for each r of `rows` (adapters[i] that of rows[i]): x[r] · its adapter's A rows,
    0 past its rank."""
    index, first = _selection(rows)
    _cadence.lora_shrink_rows_.default(x, t.rows_in, t.a_idx, t.ranks, adapters, index, first, h)


def expand_rows_(
    y: torch.Tensor, h: torch.Tensor, t: ExpandTables, rows: Rows, adapters: torch.Tensor
) -> None:
    """y[r, piece] += h[r, its piece's ranks] @ its Bᵀ rows, for each r of `rows`."""
    index, first = _selection(rows)
    _cadence.lora_expand_rows_.default(
        y, h, t.rows_out, t.b_idx, t.piece_ranks, t.rank_start, t.out_offset, adapters, index,
        first,
    )  # fmt: skip
