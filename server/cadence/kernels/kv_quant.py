"""The quantized KV cache (`cadence.kv_format`) in the Triton kernels: how the cache write
quantizes a head's row, and how the attention kernels scale what they load. QUANT, a
constexpr of each kernel, says which scales the cache has."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NO_SCALES, TOKEN_SCALES, LAYER_SCALES = 0, 1, 2  # float; int8 per slot and KV head; fp8


def quant_mode(cache: torch.Tensor, scale: torch.Tensor | None) -> int:
    """QUANT for a cache and its scales (None: a float cache). The kernels find a slot's
    scale at its element offset / head_dim, so both must be contiguous."""
    if scale is None:
        return NO_SCALES
    assert cache.is_contiguous() and scale.is_contiguous() and scale.dtype == torch.float32
    return TOKEN_SCALES if cache.dtype == torch.int8 else LAYER_SCALES


@triton.jit
def quantize_row(x, scale_ptr, scale_at, QUANT: tl.constexpr, FP8_MAX: tl.constexpr):
    """One head's row x [BLOCK_D] (float32, zeros past head_dim) as the cache stores it:
    int8 with its scale (amax / 127) stored at scale_ptr + scale_at, or fp8 over the
    layer's scale, saturated. x + 1.5 * 2^23 - 1.5 * 2^23 rounds |x| < 2^22 to the
    nearest integer, ties to even, as torch.round does (and the interpreter runs it)."""
    if QUANT == 1:
        amax = tl.max(tl.abs(x), axis=0)
        inv = tl.where(amax > 0, 127.0 / amax, 0.0)
        r = (x * inv + 12582912.0) - 12582912.0
        tl.store(scale_ptr + scale_at, amax / 127.0)
        return tl.minimum(tl.maximum(r, -127.0), 127.0)
    else:
        inv = 1.0 / tl.load(scale_ptr)
        return tl.minimum(tl.maximum(x * inv, -FP8_MAX), FP8_MAX)


@triton.jit
def fp8_grid(x, MANTISSA: tl.constexpr, MIN_NORMAL: tl.constexpr, SUBNORMALS: tl.constexpr):
    """x (float32, within the format's range) rounded to the nearest fp8 value, ties to
    even, still as float32: the conversion that follows is then exact. Rounding here
    rather than in the conversion: the interpreter's float32 -> e4m3 conversion drops the
    carry of a mantissa that rounds up into the next binade (127.2 became 64). Normal
    values keep MANTISSA bits (the float32 bits rounded as f32_to_fp8 does in C++);
    below MIN_NORMAL, multiples of 1 / SUBNORMALS."""
    drop: tl.constexpr = 23 - MANTISSA
    bits = x.to(tl.int32, bitcast=True)
    lsb = (bits >> drop) & 1
    rounded = (bits + ((1 << (drop - 1)) - 1) + lsb) & ~((1 << drop) - 1)
    normal = rounded.to(tl.float32, bitcast=True)
    small = ((x * SUBNORMALS + 12582912.0) - 12582912.0) / SUBNORMALS
    return tl.where(tl.abs(x) < MIN_NORMAL, small, normal)


@triton.jit
def scaled(x, scale_ptr, slot_head, valid, QUANT: tl.constexpr):
    """Rows x [N, BLOCK_D] loaded from the cache, as float32 values: times each row's
    scale (int8: at scale_ptr + slot_head [N], the slot * kv_heads + head of each row)
    or the layer's (fp8); a float cache's rows as they are."""
    if QUANT == 1:
        s = tl.load(scale_ptr + slot_head, mask=valid, other=0.0)
        return x.to(tl.float32) * s[:, None]
    elif QUANT == 2:
        return x.to(tl.float32) * tl.load(scale_ptr)
    else:
        return x
