"""Float weights into the two quantized formats (what `--quantize` does at load).

int8: symmetric per output channel, `scale = max|w| / 127`. int4: asymmetric per group of
input columns, the group's [min, max] mapped onto the 16 levels, written in the
`Int4Weight` form (`(q - 8) * scale + zero`, so `zero = min + 8 * scale`)."""

from __future__ import annotations

import torch

from cadence.quant.formats import INT4_OFFSET, INT8_BLOCK, Int4Weight, Int8BlockWeight, Int8Weight

INT8_MAX = 127  # symmetric: -127..127, so that -w quantizes to -q
INT4_LEVELS = 15  # q in 0..15
# The smallest scale: a channel or group whose values are all equal would divide by zero.
_TINY = torch.finfo(torch.float32).tiny


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    """`w` [out, in] (any float dtype) -> q int8, scale float32 [out]."""
    w = w.detach().to(torch.float32)
    scale = (w.abs().amax(dim=1) / INT8_MAX).clamp_min(_TINY)
    q = torch.round(w / scale.unsqueeze(1)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return Int8Weight(q, scale)


def quantize_int8_blocks(w: torch.Tensor) -> Int8BlockWeight:
    """`w` [out, in] -> q int8, scale float32 [out, in // 32]: symmetric per block of 32
    input columns, as GGUF's Q8_0 (`scale = max|w| / 127`). A Q8_0 tensor's dequantized
    values give back its own blocks: each block's largest value is 127 scales."""
    out_features, in_features = w.shape
    if in_features % INT8_BLOCK:
        raise ValueError(f"{in_features} input columns do not split into blocks of {INT8_BLOCK}")
    blocks = w.detach().to(torch.float32).reshape(out_features, -1, INT8_BLOCK)
    scale = (blocks.abs().amax(dim=-1) / INT8_MAX).clamp_min(_TINY)
    q = torch.round(blocks / scale.unsqueeze(-1)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return Int8BlockWeight(q.reshape(out_features, in_features), scale)


def quantize_int4(w: torch.Tensor, group_size: int) -> Int4Weight:
    """`w` [out, in] -> q 0..15 per element, scale and zero per (row, group of
    `group_size` input columns); `in` must be a multiple of `group_size`."""
    out_features, in_features = w.shape
    if in_features % group_size:
        raise ValueError(f"{in_features} input columns do not split into groups of {group_size}")
    groups = w.detach().to(torch.float32).reshape(out_features, -1, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((high - low) / INT4_LEVELS).clamp_min(_TINY)
    q = torch.round((groups - low.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp_(0, INT4_LEVELS)
    zero = low + INT4_OFFSET * scale
    return Int4Weight(q.to(torch.uint8).reshape(out_features, in_features), scale, zero, group_size)


def group_size_for(in_features: int, requested: int) -> int:
    """The group size a linear of `in_features` inputs is quantized with: `requested`
    when it divides them, else the largest power of two below it that does (SmolLM2's
    576-wide inputs take 64 under the default 128), at least 32 (the CPU kernel's
    smallest)."""
    group = requested
    while group >= 32:
        if in_features % group == 0:
            return group
        group //= 2
    raise ValueError(
        f"{in_features} input columns have no int4 group of {requested} or a power of two "
        "below it down to 32"
    )
