"""Rows of consecutive tokens laid end to end for one forward: where each token sits in
its request's blocks, and the shape facts the attention backends dispatch on (one
`StepLayout`). The rows come decode first (single-token rows, then short chunks, then
longer ones), as the backends expect. The target's steps (`BatchState.prepare`) and the
draft model's forwards (`cadence.speculative.draft_batch`) both lay out their rows here."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cadence.attention_backends import StepLayout
from cadence.attention_backends.base import SHORT_CHUNK


def decode_first(counts: list[int]) -> list[int]:
    """The order (indices into `counts`) that puts single-token rows first, then short
    chunks, then the longer ones; stable within each kind."""
    return sorted(range(len(counts)), key=lambda i: (counts[i] != 1, counts[i] > SHORT_CHUNK))


@dataclass(slots=True)
class FlatRows:
    row: torch.Tensor  # [T] each token's row
    positions: torch.Tensor  # [T]
    layout: StepLayout  # on CPU


def flat_rows(
    tables: torch.Tensor, starts: torch.Tensor, counts: list[int], block_size: int
) -> FlatRows:
    """Row i holds `counts[i]` tokens from position `starts[i]`, written through block
    table `tables[i]`; the rows already in `decode_first` order."""
    n = torch.tensor(counts)
    total = sum(counts)
    query_start = torch.zeros(len(counts) + 1, dtype=torch.long)
    torch.cumsum(n, 0, out=query_start[1:])
    row = torch.repeat_interleave(torch.arange(len(counts)), n, output_size=total)
    positions = starts[row] + torch.arange(total) - query_start[row]
    blocks = tables[row, positions // block_size]
    context_lens = starts + n
    lens = context_lens.tolist()
    num_decode = sum(1 for c in counts if c == 1)
    short = [c for c in counts if 1 < c <= SHORT_CHUNK]
    decode_blocks = -(-max(lens[:num_decode], default=0) // block_size)
    prefill_blocks = -(-max(lens[num_decode:], default=0) // block_size)
    # Entries past a row's blocks are read by the gathering backends (then masked): point
    # them at its own first block, never at whatever id was left there -- such a block may
    # hold a LoRA adapter's weights, which read as keys or values can be NaN, and a masked
    # NaN value still poisons the attention's weighted sum.
    width = max(decode_blocks, prefill_blocks)
    spanned = (context_lens + block_size - 1) // block_size
    past = torch.arange(width) >= spanned.unsqueeze(1)
    padded_tables = torch.where(past, tables[:, :1], tables[:, :width])
    layout = StepLayout(
        slot_mapping=blocks * block_size + positions % block_size,
        query_start=query_start,
        context_lens=context_lens,
        block_tables=padded_tables,
        block_size=block_size,
        num_decode=num_decode,
        max_query_len=max(counts[num_decode:], default=1),
        decode_blocks=decode_blocks,
        prefill_blocks=prefill_blocks,
        # every longer row starts at position 0 (no cached prefix)
        prefill_from_start=lens[num_decode:] == counts[num_decode:],
        num_short=len(short),
        short_tokens=sum(short),
    )
    return FlatRows(row=row, positions=positions, layout=layout)
