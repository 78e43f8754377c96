"""Quantized products on CPU through torch's packed weight-only kernels.

- int8: `aten._weight_int8pack_mm(x, q [out, in] int8, scale [out])`, the scale in the
  activations' dtype.
- int4: `aten._convert_weight_to_int4pack_for_cpu(q int32 [out, in] 0..15)` packs the
  weight once; `aten._weight_int4pack_mm_for_cpu(x, packed, group, scales_and_zeros)`
  computes with `w = (q - 8) * scale + zero` -- the `Int4Weight` convention -- reading
  `scales_and_zeros` as [in / group, out, 2] (scale, zero) in the activations' dtype. The
  packing wants a multiple of 16 output rows: others are padded with zero rows, cut off
  the output.

Both run in bfloat16 whatever the model's dtype: torch vectorizes them for bfloat16
activations only (with float32 ones they run scalar loops, 10 to 100x slower than the
float product they replace: SmolLM2's 1536x576 at 1 row, int8 0.27 ms and int4 2.7 ms
against 0.09 ms for oneDNN float32; in bfloat16 0.03 and 0.05 ms, even with ATen held to
AVX2). A float32 model's input is rounded to bfloat16 for the product and its output
widened back: an error of 2^-9 relative, far below the weights' quantization error. An
act-order `perm` is applied by reordering the input's columns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cadence.quant.formats import Int4Weight, Int8Weight

INT4_ROW_MULTIPLE = 16  # the CPU int4 packing's output-row granularity
INT4_GROUPS = (256, 128, 64, 32)  # the group sizes the CPU int4 product takes
# The bfloat16 int8 product reads past the input's end (and crashes) when the input width
# is not a multiple of 16 (seen at 24, 40, 72 in torch 2.15): such weights get zero columns.
INT8_COL_MULTIPLE = 16
COMPUTE_DTYPE = torch.bfloat16  # the activations' dtype the kernels run in


def _flat(x: torch.Tensor) -> torch.Tensor:
    """x [..., in] as the contiguous 2-D bfloat16 input the kernels take."""
    return x.reshape(-1, x.shape[-1]).to(COMPUTE_DTYPE).contiguous()


class Int8CpuKernel:
    """y = x @ (q * scale).T with the weight kept as int8."""

    def __init__(self, weight: Int8Weight) -> None:
        self.out_features, self.in_features = weight.shape
        self.pad = -self.in_features % INT8_COL_MULTIPLE
        self.q = F.pad(weight.q, (0, self.pad)).contiguous()
        self.scale = weight.scale.to(COMPUTE_DTYPE)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = _flat(x)
        if self.pad:
            flat = F.pad(flat, (0, self.pad))
        y = torch.ops.aten._weight_int8pack_mm(flat, self.q, self.scale)
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * self.scale.element_size()


def _kernel_group(group_size: int) -> int:
    """The CPU kernel's group for a weight quantized in groups of `group_size`: the
    largest it takes that divides it (GPTQ's per-channel "groups" of a whole row too)."""
    for g in INT4_GROUPS:
        if group_size % g == 0:
            return g
    raise ValueError(f"int4 groups of {group_size}: the CPU kernel takes multiples of 32 only")


class Int4CpuKernel:
    """y = x[:, perm] @ ((q - 8) * scale + zero).T with the weight packed two per byte."""

    def __init__(self, weight: Int4Weight) -> None:
        self.out_features, self.in_features = weight.shape
        self.group_size = _kernel_group(weight.group_size)
        repeat = weight.group_size // self.group_size
        padded = -(-self.out_features // INT4_ROW_MULTIPLE) * INT4_ROW_MULTIPLE
        pad = padded - self.out_features
        q = weight.q.to(torch.int32)
        # a larger group is several kernel groups sharing one scale and zero
        scale = weight.scale.repeat_interleave(repeat, dim=1)
        zero = weight.zero.repeat_interleave(repeat, dim=1)
        if pad:  # zero rows: q = 8, scale = zero = 0
            q = torch.cat([q, q.new_full((pad, self.in_features), 8)])
            scale = torch.cat([scale, scale.new_zeros(pad, scale.shape[1])])
            zero = torch.cat([zero, zero.new_zeros(pad, zero.shape[1])])
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
        pairs = torch.stack([scale.t(), zero.t()], dim=-1)
        self.scales_and_zeros = pairs.to(COMPUTE_DTYPE).contiguous()
        self.perm = weight.perm
        self.padded = pad > 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = _flat(x)
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
