"""KV-cache write: new keys and values scattered into their cache slots, quantized when the
cache is (`cadence.kv_format`): int8 with each token's per-head scale written beside it,
fp8 scaled by its layer's scale."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cadence.kernels.kv_quant import LAYER_SCALES, fp8_grid, quant_mode, quantize_row


@triton.jit
def _kv_write_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    block_size,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MANTISSA: tl.constexpr,
    FP8_MIN_NORMAL: tl.constexpr,
    FP8_SUBNORMALS: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # a padding token: nothing to store
        return
    d = tl.arange(0, BLOCK_D)
    dm = d < HEAD_DIM
    dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs + h * stride_ch + d
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=dm, other=0.0)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=dm, other=0.0)
    if QUANT != 0:
        scale_at = slot * tl.num_programs(1) + h  # scales [slots, kv_heads], contiguous
        k = quantize_row(k.to(tl.float32), k_scale_ptr, scale_at, QUANT, FP8_MAX)
        v = quantize_row(v.to(tl.float32), v_scale_ptr, scale_at, QUANT, FP8_MAX)
        if QUANT == 2:
            k = fp8_grid(k, FP8_MANTISSA, FP8_MIN_NORMAL, FP8_SUBNORMALS)
            v = fp8_grid(v, FP8_MANTISSA, FP8_MIN_NORMAL, FP8_SUBNORMALS)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=dm)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=dm)


def kv_write(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """k, v: [T, kv_heads, head_dim]; caches [num_blocks, block_size, kv_heads, head_dim];
    slot_mapping [T] (a negative slot skips the token); a quantized cache's scales in
    k_scale, v_scale (int8's [num_blocks, block_size, kv_heads] written, fp8's read)."""
    t, heads, dim = k.shape
    if t == 0:
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_cache.is_contiguous()
    assert k_cache.stride() == v_cache.stride()
    quant = quant_mode(k_cache, k_scale)
    fp8 = torch.finfo(k_cache.dtype) if quant == LAYER_SCALES else None
    mantissa = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}.get(k_cache.dtype, 0)
    _kv_write_kernel[(t, heads)](
        k,
        v,
        k_cache,
        v_cache,
        k_scale if k_scale is not None else k_cache,
        v_scale if v_scale is not None else v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_cache.shape[1],
        HEAD_DIM=dim,
        BLOCK_D=triton.next_power_of_2(dim),
        QUANT=quant,
        FP8_MAX=float(fp8.max) if fp8 else 0.0,
        FP8_MANTISSA=mantissa,
        FP8_MIN_NORMAL=float(fp8.smallest_normal) if fp8 else 0.0,
        # the subnormal step: the smallest normal over 2^mantissa
        FP8_SUBNORMALS=float(2**mantissa / fp8.smallest_normal) if fp8 else 1.0,
    )


def kv_write_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep].to(v_cache.dtype)
