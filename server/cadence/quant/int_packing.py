"""Integers packed into int32 words, and integer zero points as `Int4Weight`'s float zero.

GPTQ and AWQ both pack 32 // bits values into each int32, the first value in the lowest
bits; they differ in which dimension they pack along and (AWQ) in the order of the
values within a word, which their readers undo around `unpack_int32`.
"""

from __future__ import annotations

import torch

from cadence.quant.formats import INT4_OFFSET, Int4Weight


def unpack_int32(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [..., n] -> int32 [..., n * (32 // bits)]: value `j * per + k` is bits
    [k * bits, (k + 1) * bits) of word j, unsigned (per = 32 // bits)."""
    if packed.dtype != torch.int32:
        raise ValueError(f"packed integers must be int32, found {packed.dtype}")
    per = 32 // bits
    shifts = torch.arange(0, per * bits, bits, dtype=torch.int32)
    # arithmetic shift of a negative word fills with ones; the mask drops them
    values = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return values.reshape(*packed.shape[:-1], packed.shape[-1] * per)


def int4_with_zero_points(
    q: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    perm: torch.Tensor | None = None,
) -> Int4Weight:
    """`w = (q - z) * s` per group as an `Int4Weight`: q int [out, in] 0..15, integer
    zeros and float scales [out, groups]. `(q - z) * s = (q - 8) * s + (8 - z) * s`;
    with fp16/bf16 scales every term is exact in float32, so nothing is re-rounded."""
    out_features, in_features = q.shape
    groups = scales.shape[1]
    if zeros.shape != scales.shape or scales.shape[0] != out_features:
        raise ValueError(f"zeros {tuple(zeros.shape)} / scales {tuple(scales.shape)} mismatch")
    if in_features % groups:
        raise ValueError(f"{in_features} input columns do not split into {groups} equal groups")
    scale = scales.to(torch.float32).contiguous()
    zero = (INT4_OFFSET - zeros.to(torch.float32)) * scale
    return Int4Weight(q.to(torch.uint8).contiguous(), scale, zero, in_features // groups, perm)
