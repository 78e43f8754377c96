"""The flat forward inputs of one draft-model forward: rows of consecutive tokens, each
at its own start position in its request's blocks, laid out as the attention backends
expect (single-token rows first, then short chunks, then the longer ones), as
`BatchState.prepare` lays out the target's."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cadence.attention_backends import StepLayout
from cadence.attention_backends.base import SHORT_CHUNK


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
    order = sorted(range(len(slots)), key=lambda i: (counts[i] != 1, counts[i] > SHORT_CHUNK))
    n = torch.tensor([counts[i] for i in order])
    start = torch.tensor([starts[i] for i in order])
    rows = torch.tensor([slots[i] for i in order])
    total = int(n.sum())
    query_start = torch.zeros(len(order) + 1, dtype=torch.long)
    torch.cumsum(n, 0, out=query_start[1:])
    row = torch.repeat_interleave(torch.arange(len(order)), n, output_size=total)
    positions = start[row] + torch.arange(total) - query_start[row]
    blocks = block_tables[rows[row], positions // block_size]
    context_lens = start + n
    lens, sizes = context_lens.tolist(), n.tolist()
    num_decode = sizes.count(1)
    short = [c for c in sizes if 1 < c <= SHORT_CHUNK]
    decode_blocks = -(-max(lens[:num_decode], default=0) // block_size)
    prefill_blocks = -(-max(lens[num_decode:], default=0) // block_size)
    layout = StepLayout(
        slot_mapping=(blocks * block_size + positions % block_size).to(device),
        query_start=query_start.to(device),
        context_lens=context_lens.to(device),
        block_tables=block_tables[rows, : max(decode_blocks, prefill_blocks)].to(device),
        block_size=block_size,
        num_decode=num_decode,
        num_short=len(short),
        short_tokens=sum(short),
        max_query_len=max(sizes[num_decode:], default=1),
        decode_blocks=decode_blocks,
        prefill_blocks=prefill_blocks,
        prefill_from_start=lens[num_decode:] == sizes[num_decode:],
    )
    order_t = torch.tensor(order)
    last = torch.empty(len(order), dtype=torch.long)
    last[order_t] = query_start[1:] - 1
    return DraftBatch(order_t, positions.to(device), layout, last.to(device))
