"""Rotary embedding (rotate-half layout) applied in place to queries and keys."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    stride_xt,
    stride_xh,
    stride_ct,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_H)
    m = d < HALF
    c = tl.load(cos_ptr + t * stride_ct + d, mask=m).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_ct + d, mask=m).to(tl.float32)
    base = x_ptr + t * stride_xt + h * stride_xh
    x1 = tl.load(base + d, mask=m).to(tl.float32)
    x2 = tl.load(base + HALF + d, mask=m).to(tl.float32)
    tl.store(base + d, (x1 * c - x2 * s).to(x_ptr.dtype.element_ty), mask=m)
    tl.store(base + HALF + d, (x2 * c + x1 * s).to(x_ptr.dtype.element_ty), mask=m)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim], rotated in place; cos/sin: [T, head_dim] (the two halves
    equal, as `RotaryEmbedding.cos_sin` builds them) or [T, 1, head_dim]."""
    t, heads, dim = x.shape
    assert x.stride(-1) == 1 and dim % 2 == 0
    cos = cos.reshape(cos.shape[0], -1)
    sin = sin.reshape(sin.shape[0], -1)
    assert cos.stride() == sin.stride() and cos.stride(-1) == 1
    if t > 0:
        _rotary_kernel[(t, heads)](
            x,
            cos,
            sin,
            x.stride(0),
            x.stride(1),
            cos.stride(0),
            HALF=dim // 2,
            BLOCK_H=triton.next_power_of_2(dim // 2),
        )
    return x


def rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos = cos.reshape(cos.shape[0], 1, -1).float()
    sin = sin.reshape(sin.shape[0], 1, -1).float()
    xf = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)
