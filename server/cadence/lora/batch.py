"""One step's LoRA tables, built once before the forward for every layer.

From the forward's request rows (in its order: decode rows first, see
`cadence.shard.flat_rows`), each with its adapter or none: the step's adapter list,
`row_adapter` [T], the rows grouped by adapter (`Segments`), and per layer kind the
resident tables indexed by the step's adapters' slots -- `a_idx` [layers, A, Rmax],
`ranks` [layers, A], and per output piece `b_idx`, `ranks`, `rank_start` -- so layer l's
tables are the views `[l]`. Entries of an adapter that leaves a layer (or piece) alone
point at another step adapter's rows there: every index names finite numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from cadence.lora.resident import IndexTable, ResidentAdapters
from cadence.lora.torch_ops import SEGMENT_MIN_ROWS, Segments, group_rows


@dataclass(frozen=True, slots=True)
class StepIndex:
    """One matrix kind's tables for this step, per layer: rows [L, A, R], ranks [L, A],
    rank_start [L, A]; `active` [L]: whether any step adapter has it on that layer."""

    rows: torch.Tensor
    ranks: torch.Tensor
    rank_start: torch.Tensor
    active: list[bool]


@dataclass(frozen=True, slots=True)
class StepPiece:
    out_offset: int
    out_size: int
    index: StepIndex


@dataclass(frozen=True, slots=True)
class StepKind:
    in_features: int
    a: StepIndex
    pieces: tuple[StepPiece, ...]


@dataclass(frozen=True, slots=True)
class LoraStep:
    adapters: list[str]  # the step's adapters; row_adapter indexes it
    row_adapter: torch.Tensor  # [T] long, -1: no adapter
    segments: Segments
    kinds: dict[str, StepKind]  # the layer kinds some step adapter touches
    # the Triton kernels' split of the rows (`cadence.kernels.lora.RowPlan`), when they serve
    row_plan: Any = None


def _step_index(table: IndexTable, slots: torch.Tensor) -> StepIndex | None:
    """`table` for the step's adapters (slots [A]), layers first; None when none of them
    has it on any layer."""
    ranks = table.ranks[slots].T.contiguous()  # [L, A]
    has = ranks > 0
    active = has.any(dim=1)
    if not bool(active.any()):
        return None
    rmax = int(ranks.max())
    rows = table.rows[slots, :, :rmax].transpose(0, 1)  # [L, A, R]
    # an adapter without this matrix on a layer reads the first adapter that has it
    donor = has.to(torch.uint8).argmax(dim=1)
    donor_rows = rows[torch.arange(rows.shape[0], device=rows.device), donor]
    rows = torch.where(has.unsqueeze(2), rows, donor_rows.unsqueeze(1)).contiguous()
    rank_start = table.rank_start[slots].T.contiguous()
    return StepIndex(rows, ranks, rank_start, active.tolist())


def build_step(
    request_adapters: list[str | None],
    counts: list[int],
    resident: ResidentAdapters,
    segment_min_rows: int = SEGMENT_MIN_ROWS,
    triton: bool = False,
) -> LoraStep | None:
    """The step's tables for requests (in the forward's order) computing `counts` rows
    each; None when no request has an adapter. An adapter's rows take the segment path
    from `segment_min_rows` on; with `triton`, the step also carries the Triton kernels'
    row plan (their own split between segment tiles and single rows)."""
    names = [n for n in dict.fromkeys(request_adapters) if n is not None]
    if not names:
        return None
    device = resident.device
    index_of = {n: i for i, n in enumerate(names)}
    per_request = [index_of[n] if n is not None else -1 for n in request_adapters]
    runs, start = [], 0
    for a, n in zip(per_request, counts, strict=True):
        runs.append((start, n, a))
        start += n
    row_adapter = torch.repeat_interleave(
        torch.tensor(per_request), torch.tensor(counts), output_size=start
    ).to(device)
    slots = torch.tensor([resident.slot_of[n] for n in names], device=device)
    kinds = {}
    for kind, table in resident.kinds.items():
        a = _step_index(table.a, slots)
        if a is None:
            continue
        pieces = []
        for (offset, size), piece_table in table.pieces.items():
            piece = _step_index(piece_table, slots)
            if piece is not None:
                pieces.append(StepPiece(offset, size, piece))
        kinds[kind] = StepKind(table.in_features, a, tuple(pieces))
    row_plan = None
    if triton:
        from cadence.kernels.lora import plan_rows  # imports triton

        adapted = [(s, s + n, a) for s, n, a in runs if a >= 0 and n > 0]
        row_plan = plan_rows(start, adapted, device)
    segments = group_rows(runs, device, segment_min_rows)
    return LoraStep(names, row_adapter, segments, kinds, row_plan)
