"""What every implementation of one layer's LoRA products takes (torch's,
`cadence.lora.torch_ops`; the C++ row kernels', `cadence.lora.cpu_rows`; Triton's,
`cadence.kernels.lora`; and the plain references, `cadence.kernels.reference`): the
pool's rows, the step adapters' index tables and each token row's adapter, for the
shrink (h = x Aᵀ) and for one output piece's expand (y[:, piece] += h Bᵀ).

`row_adapter[t]` is row t's index into the step's adapter list (-1: no adapter, the row
is left alone); an adapter's rows past its rank are never read."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class ShrinkTables:
    """h[t, j] = x[t] · rows_in[a_idx[a, j]] for a = row_adapter[t] and j < ranks[a]."""

    rows_in: torch.Tensor  # [N, in] the pool's rows, as wide as the layer's input
    a_idx: torch.Tensor  # [A, Rmax] the pool row of each adapter's A row
    ranks: torch.Tensor  # [A]
    row_adapter: torch.Tensor  # [T]


@dataclass(slots=True)
class ExpandTables:
    """y[t, out_offset : out_offset + out] += h[t, rank_start[a] : rank_start[a] + r] @
    rows_out[b_idx[a, :r]] for a = row_adapter[t], r = piece_ranks[a]."""

    rows_out: torch.Tensor  # [N, out] the pool's rows, as wide as the piece's output
    b_idx: torch.Tensor  # [A, Rpiece] the pool row of each adapter's Bᵀ row
    piece_ranks: torch.Tensor  # [A]
    rank_start: torch.Tensor  # [A] the piece's first column of h
    out_offset: int  # the piece's first column of y
    row_adapter: torch.Tensor  # [T]
