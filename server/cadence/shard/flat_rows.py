"""Rows of consecutive tokens laid end to end for one forward: where each token sits in
its request's blocks, and the shape facts the attention backends dispatch on (one
`StepLayout`). The rows come decode first (single-token rows, then short chunks, then
longer ones), as the backends expect. The target's steps (`BatchState.prepare`) and the
draft model's forwards (`cadence.speculative.draft_batch`) both lay out their rows here."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from cadence.attention_backends import StepLayout
from cadence.attention_backends.base import SHORT_CHUNK


def decode_first(counts: list[int]) -> list[int]:
    """The order (indices into `counts`) that puts single-token rows first, then short
    chunks, then the longer ones; stable within each kind."""
    return sorted(range(len(counts)), key=lambda i: (counts[i] != 1, counts[i] > SHORT_CHUNK))


@dataclass(slots=True)
class FlatRows:
    row: np.ndarray  # [T] each token's row
    positions: np.ndarray  # [T]
    layout: StepLayout  # on CPU


def flat_rows(table: np.ndarray, start: np.ndarray, counts: list[int], block_size: int) -> FlatRows:
    """Row i holds `counts[i]` tokens from position `start[i]`, written through block
    table `table[i]` (int64 arrays); the rows already in `decode_first` order. The index
    arithmetic runs in numpy: on a step's few dozen rows a numpy call costs about a
    microsecond against several in torch's dispatcher, and this is the step's serial path
    (the kernels' other threads wait)."""
    n = np.asarray(counts, dtype=np.int64)
    total = int(n.sum())
    query_start = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(n, out=query_start[1:])
    row = np.repeat(np.arange(len(counts), dtype=np.int64), n)
    positions = start[row] + np.arange(total, dtype=np.int64) - query_start[row]
    blocks = table[row, positions // block_size]
    context_lens = start + n
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
    past = np.arange(width) >= spanned[:, None]
    padded_tables = np.where(past, table[:, :1], table[:, :width])
    layout = StepLayout(
        slot_mapping=torch.from_numpy(blocks * block_size + positions % block_size),
        query_start=torch.from_numpy(query_start),
        context_lens=torch.from_numpy(context_lens),
        block_tables=torch.from_numpy(padded_tables),
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
