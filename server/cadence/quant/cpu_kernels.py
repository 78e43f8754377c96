"""Quantized products on CPU through torch's packed weight-only kernels.

- int8: `aten._weight_int8pack_mm(x, q [out, in] int8, scale [out])`, the scale in the
  activations' dtype.
- int4: `aten._convert_weight_to_int4pack_for_cpu(q int32 [out, in] 0..15)` packs the
  weight once; `aten._weight_int4pack_mm_for_cpu(x, packed, group, scales_and_zeros)`
  computes with `w = (q - 8) * scale + zero` -- the `Int4Weight` convention -- reading
  `scales_and_zeros` as [in / group, out, 2] (scale, zero) in the activations' dtype. The
  packing wants a multiple of 16 output rows: others are padded with zero rows, cut off
  the output.

Both take float32, bfloat16 and float16 activations with a contiguous last dimension;
an act-order `perm` is applied by reordering the input's columns.
"""

from __future__ import annotations

import torch

from cadence.quant.formats import Int4Weight, Int8Weight

INT4_ROW_MULTIPLE = 16  # the CPU int4 packing's output-row granularity


def _flat(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., in] as the contiguous 2-D input the kernels take."""
    return x.reshape(-1, x.shape[-1]).to(dtype).contiguous()


class Int8CpuKernel:
    """y = x @ (q * scale).T with the weight kept as int8."""

    def __init__(self, weight: Int8Weight, dtype: torch.dtype) -> None:
        self.out_features, self.in_features = weight.shape
        self.q = weight.q.contiguous()
        self.scale = weight.scale.to(dtype)
        self.dtype = dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(_flat(x, self.dtype), self.q, self.scale)
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * self.scale.element_size()


class Int4CpuKernel:
    """y = x[:, perm] @ ((q - 8) * scale + zero).T with the weight packed two per byte."""

    def __init__(self, weight: Int4Weight, dtype: torch.dtype) -> None:
        self.out_features, self.in_features = weight.shape
        self.group_size = weight.group_size
        padded = -(-self.out_features // INT4_ROW_MULTIPLE) * INT4_ROW_MULTIPLE
        pad = padded - self.out_features
        q = weight.q.to(torch.int32)
        scale, zero = weight.scale, weight.zero
        if pad:  # zero rows: q = 8, scale = zero = 0
            q = torch.cat([q, q.new_full((pad, self.in_features), 8)])
            scale = torch.cat([scale, scale.new_zeros(pad, scale.shape[1])])
            zero = torch.cat([zero, zero.new_zeros(pad, zero.shape[1])])
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
        self.scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(dtype).contiguous()
        self.perm = weight.perm
        self.padded = pad > 0
        self.dtype = dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = _flat(x, self.dtype)
        if self.perm is not None:
            flat = flat.index_select(1, self.perm)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            flat, self.packed, self.group_size, self.scales_and_zeros
        )
        if self.padded:
            y = y[:, : self.out_features]
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    @property
    def nbytes(self) -> int:
        sz = self.scales_and_zeros
        return self.packed.numel() + sz.numel() * sz.element_size()
