"""GGUF Q4_0 / Q4_1 blocks read straight into `Int4Weight` (group size 32), no float copy.

A block covers 32 consecutive input columns of one row: a float16 step `d` (Q4_1: then a
float16 minimum `m`), then 16 bytes whose low nibbles are columns 0..15 and high nibbles
columns 16..31. Q4_0 means `w = (q - 8) * d`; Q4_1 means `w = q * d + m`, which is
`(q - 8) * d + (m + 8 d)` in Int4Weight's terms.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType

from cadence.quant.formats import INT4_OFFSET, Int4Weight

BLOCK = 32  # columns per block, the Int4Weight group size
INT4_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1)
_HEADER_BYTES = {GGMLQuantizationType.Q4_0: 2, GGMLQuantizationType.Q4_1: 4}


def int4_from_blocks(data: np.ndarray, qtype: GGMLQuantizationType, rows: int) -> Int4Weight:
    """`data`: the tensor's bytes as the GGUF reader gives them (uint8, one row of blocks
    per output row)."""
    header = _HEADER_BYTES[qtype]
    blocks = np.ascontiguousarray(data).reshape(rows, -1, header + BLOCK // 2)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    packed = blocks[..., header:]
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(rows, -1)
    if qtype == GGMLQuantizationType.Q4_0:
        zero = np.zeros_like(d)
    else:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero = m + np.float32(INT4_OFFSET) * d
    return Int4Weight(
        q=torch.from_numpy(q),
        scale=torch.from_numpy(d),
        zero=torch.from_numpy(zero),
        group_size=BLOCK,
    )
