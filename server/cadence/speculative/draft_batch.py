"""The flat forward inputs of one draft-model forward: rows of consecutive tokens, each
at its own start position in its request's blocks, laid out as the attention backends
expect (`cadence.shard.flat_rows`, as `BatchState.prepare` lays out the target's)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from cadence.attention_backends import StepLayout
from cadence.shard.flat_rows import decode_first, flat_rows


@dataclass(slots=True)
class DraftBatch:
    order: torch.Tensor  # [B] the given row at each flat row
    positions: torch.Tensor  # [T] in flat order, on the device
    layout: StepLayout  # on the device
    last: torch.Tensor  # [B] each given row's last token's index in the flat batch


def draft_batch(
    block_tables: torch.Tensor,
    block_size: int,
    slots: list[int],
    starts: list[int],
    counts: list[int],
    device: torch.device,
) -> DraftBatch:
    """Rows `i` of `counts[i]` tokens from position `starts[i]` of slot `slots[i]`, their
    keys and values written through the slot's row of `block_tables` (CPU)."""
    order = decode_first(counts)
    rows = np.array([slots[i] for i in order], dtype=np.int64)
    start = np.array([starts[i] for i in order], dtype=np.int64)
    flat = flat_rows(block_tables.numpy()[rows], start, [counts[i] for i in order], block_size)
    order_t = torch.tensor(order)
    last = torch.empty(len(order), dtype=torch.long)
    last[order_t] = flat.layout.query_start[1:] - 1
    positions = torch.from_numpy(flat.positions).to(device)
    return DraftBatch(order_t, positions, flat.layout.to(device), last.to(device))
