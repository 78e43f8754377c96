"""A layer's quantized weight as the kernels hold it, and which products it serves.

A layer's weight may come in pieces that cannot share one kernel call (the q, k and v
projections of a GPTQ act-order checkpoint each have their own input order, or a GGUF
file stores them in different types): the product then runs each piece's kernel and
concatenates their outputs. Compatible pieces are merged into one kernel first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import Enum

import torch

from cadence.quant.crossover import ALL_ROWS
from cadence.quant.formats import Int4Weight, Int8BlockWeight, Int8Weight, QuantizedWeight

Kernel = Callable[[torch.Tensor], torch.Tensor]


class ProductKernels(Enum):
    """Which kernels multiply by quantized weights: chosen once per shard, with its other
    kernels (`cadence.shard.backends.product_kernels`)."""

    TRITON = "triton"  # CUDA: `cadence.quant.triton_kernels`
    CPU_INTEGER = "cpu integer"  # the C++ integer product for the formats it takes
    CPU_TORCH = "cpu torch"  # torch's weight-only kernels


def describe(weight: QuantizedWeight) -> str:
    """ "int8", "int8 g32" or "int4 g<group>"."""
    if isinstance(weight, Int8Weight):
        return "int8"
    if isinstance(weight, Int8BlockWeight):
        return "int8 g32"
    return f"int4 g{weight.group_size}"


def _joinable(a: QuantizedWeight, b: QuantizedWeight) -> bool:
    if isinstance(a, Int8Weight) and isinstance(b, Int8Weight):
        return True
    if isinstance(a, Int8BlockWeight) and isinstance(b, Int8BlockWeight):
        return True
    if isinstance(a, Int4Weight) and isinstance(b, Int4Weight):
        same_perm = (a.perm is None and b.perm is None) or (
            a.perm is not None and b.perm is not None and torch.equal(a.perm, b.perm)
        )
        return a.group_size == b.group_size and same_perm
    return False


def _join(a: QuantizedWeight, b: QuantizedWeight) -> QuantizedWeight:
    """`a`'s rows then `b`'s, as one weight (`_joinable` ones only)."""
    if isinstance(a, Int8Weight) and isinstance(b, Int8Weight):
        return Int8Weight(torch.cat([a.q, b.q]), torch.cat([a.scale, b.scale]))
    if isinstance(a, Int8BlockWeight) and isinstance(b, Int8BlockWeight):
        return Int8BlockWeight(torch.cat([a.q, b.q]), torch.cat([a.scale, b.scale]))
    assert isinstance(a, Int4Weight) and isinstance(b, Int4Weight)
    return Int4Weight(
        torch.cat([a.q, b.q]),
        torch.cat([a.scale, b.scale]),
        torch.cat([a.zero, b.zero]),
        a.group_size,
        a.perm,
    )


def join_rows(pieces: Sequence[QuantizedWeight]) -> list[QuantizedWeight]:
    """Consecutive row pieces of one weight, merged where one kernel can serve them."""
    merged: list[QuantizedWeight] = []
    for piece in pieces:
        if merged and _joinable(merged[-1], piece):
            merged[-1] = _join(merged[-1], piece)
        else:
            merged.append(piece)
    return merged


def make_kernel(
    weight: QuantizedWeight, dtype: torch.dtype, device: torch.device, kernels: ProductKernels
) -> Kernel:
    """The kernel of `kernels` that multiplies by `weight` for activations of `dtype` on
    `device`."""
    integer = kernels is ProductKernels.CPU_INTEGER
    if isinstance(weight, Int8BlockWeight) and not integer:
        return DequantizedKernel(weight, dtype, device)
    if kernels is ProductKernels.TRITON:
        from cadence.quant import triton_kernels

        return triton_kernels.kernel_for(weight, dtype, device)
    from cadence.quant import cpu_gemm
    from cadence.quant.cpu_kernels import Int4CpuKernel, Int8CpuKernel

    if integer and cpu_gemm.takes(weight):
        return cpu_gemm.IntegerCpuKernel(weight)
    if isinstance(weight, Int8Weight):  # (torch's kernels run in bfloat16 whatever `dtype`)
        return Int8CpuKernel(weight)
    return Int4CpuKernel(weight)


class DequantizedKernel:
    """A format no kernel here takes (int8 blocks off the integer product): its float
    weight, dequantized once, through the float product."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype, device: torch.device) -> None:
        self.weight = weight.dequantize(dtype).to(device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


class QuantizedProduct:
    """y = x @ W.T (+ bias) through quantized kernels, for the row counts it serves."""

    def __init__(
        self,
        pieces: Sequence[QuantizedWeight],
        dtype: torch.dtype,
        device: torch.device,
        crossover: int,
        float_kept: bool,
        kernels: ProductKernels,
    ) -> None:
        """`pieces`: the weight's row pieces in order; `crossover`: the most rows this
        product serves while a float weight is kept (`float_kept`) for more rows;
        `kernels`: the shard's product kernels."""
        joined = join_rows(pieces)
        self.kernels = [make_kernel(w, dtype, device, kernels) for w in joined]
        self.formats = sorted({describe(w) for w in joined})
        self.out_features = sum(w.shape[0] for w in joined)
        self.crossover = crossover
        self.float_kept = float_kept

    def serves(self, rows: int) -> bool:
        return not self.float_kept or rows <= self.crossover

    @property
    def switches_by_rows(self) -> bool:
        """Some row counts take the quantized kernel and others the float copy."""
        return self.float_kept and 0 < self.crossover < ALL_ROWS

    @property
    def serves_every_row_count(self) -> bool:
        """No product goes to a float weight (a kept one is there for another reason: a
        tied embedding table)."""
        return not self.float_kept or self.crossover >= ALL_ROWS

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if len(self.kernels) == 1:
            y = self.kernels[0](x)
        else:
            y = torch.cat([kernel(x) for kernel in self.kernels], dim=-1)
        if bias is not None:
            y = y + bias
        return y

    @property
    def nbytes(self) -> int:
        return sum(getattr(k, "nbytes", 0) for k in self.kernels)
