"""Fused residual add + RMSNorm: `residual <- x + residual`, `out <- norm(residual)`,
one pass over each row (the layer's semantics: sum in the input dtype, normalize in
float32, cast back, then scale by the weight)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    stride_x,
    stride_r,
    stride_o,
    n,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=m, other=0.0)
        # rounded to the input dtype, as the unfused layer's sum is (arithmetic in float32:
        # the interpreter cannot add bfloat16 directly)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_ptr + row * stride_r + cols, x, mask=m)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n
    y = (xf * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    out = (w * y.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, out, mask=m)


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x: [T, hidden]. Without `residual`: norm(x). With it: (norm(x + residual),
    x + residual), the sum written into `residual` in place."""
    assert x.stride(-1) == 1
    out = torch.empty_like(x)
    rows, n = x.shape
    res = residual if residual is not None else x
    if rows > 0:
        _rmsnorm_kernel[(rows,)](
            x,
            res,
            weight,
            out,
            x.stride(0),
            res.stride(0),
            out.stride(0),
            n,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(n),
        )
    return out if residual is None else (out, residual)


def rmsnorm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = x + residual
    xf = x.float()
    y = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if residual is None else (y, x)
