"""Times the quantized products against the float ones on a model's linear shapes and
finds the crossover: the most rows at which the quantized kernels still win.

Every layer gets its own weights (so they stream from memory as in a real step, rather
than sit in cache); the float side is what a shard serves (`cadence.layers.packed.linear`,
the weight prepacked for cadence's float32 tiles or oneDNN where it can be), the quantized
side the kernel a shard would use (`cadence.quant.product.make_kernel`: the integer product
where the selected C++ kernels have VNNI, else torch's weight-only kernels), or torch's
when asked."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from cadence.layers.packed import linear, packed_copy, packing_supported
from cadence.quant.cpu_kernels import Int4CpuKernel, Int8CpuKernel
from cadence.quant.crossover import ALL_ROWS
from cadence.quant.formats import Int8Weight, QuantizedWeight
from cadence.quant.product import Kernel, make_kernel
from cadence.quant.quantize import group_size_for, quantize_int4, quantize_int8
from cadence.shard.backends import product_kernels

# SmolLM2-135M as cadence serves it: (out, in) of the fused qkv, o, gate_up and down
# projections of each of its 30 layers, and its LM head once.
SMOLLM2_LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
SMOLLM2_LAYERS = 30
SMOLLM2_HEAD = (49152, 576)
# Checkpoint shapes timed one by one for the record (q, k/v, gate/up, down, head).
SMOLLM2_PRODUCT_SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]


@dataclass(slots=True)
class Products:
    """One float and one quantized product per weight, over the same random weights."""

    float_products: list[Callable[[torch.Tensor], torch.Tensor]]
    quantized_products: list[Callable[[torch.Tensor], torch.Tensor]]
    in_features: list[int]


def torch_kernel(weight: QuantizedWeight) -> Kernel:
    """torch's weight-only kernel for `weight` (what serves without the integer product)."""
    return Int8CpuKernel(weight) if isinstance(weight, Int8Weight) else Int4CpuKernel(weight)


def build(
    shapes: Sequence[tuple[int, int]],
    fmt: str,
    group_size: int,
    dtype: torch.dtype,
    kernel: Callable[[QuantizedWeight], Kernel] | None = None,
) -> Products:
    """`kernel` makes the quantized side's product of a weight (default: the one a shard
    would use, `make_kernel`)."""
    cpu = torch.device("cpu")
    products = product_kernels(cpu)  # the shard's choice on this CPU
    floats, quantized, widths = [], [], []
    for out_features, in_features in shapes:
        w = (torch.randn(out_features, in_features) * 0.05).to(dtype)
        packed = packed_copy(w) if packing_supported(w) else None
        floats.append(lambda x, w=w, p=packed: linear(x, w, None, p))
        if fmt == "int8":
            q = quantize_int8(w)
        else:
            q = quantize_int4(w, group_size_for(in_features, group_size))
        quantized.append(kernel(q) if kernel else make_kernel(q, dtype, cpu, products))
        widths.append(in_features)
    return Products(floats, quantized, widths)


def time_rows(
    products: Products, rows: int, dtype: torch.dtype, repeats: int = 7
) -> tuple[float, float]:
    """(float, quantized) seconds for one pass over every product at `rows` rows: the
    sum over products of each one's fastest call. Calls are timed one by one, float and
    quantized alternately, pass after pass (so a weight is not still cached from its
    previous call): on a shared machine a single call is often left alone where a whole
    pass is not."""
    sides = (products.float_products, products.quantized_products)
    float_s, quantized_s = fastest_passes(sides, products.in_features, rows, dtype, repeats)
    return float_s, quantized_s


def fastest_passes(
    sides: Sequence[Sequence[Callable[[torch.Tensor], torch.Tensor]]],
    in_features: Sequence[int],
    rows: int,
    dtype: torch.dtype,
    repeats: int,
) -> list[float]:
    """Seconds per pass of each side (a product per weight, `in_features` its widths) at
    `rows` rows: the sum over its products of each one's fastest call, every side's call
    of a weight in turn, pass after pass, the first pass a warm-up (oneDNN primitives,
    pages)."""
    inputs = {k: torch.randn(rows, k).to(dtype) for k in set(in_features)}
    best = [[float("inf")] * len(in_features) for _ in sides]
    for _ in range(repeats + 1):
        for i, k in enumerate(in_features):
            for side, fns in enumerate(sides):
                started = time.perf_counter()
                fns[i](inputs[k])
                best[side][i] = min(best[side][i], time.perf_counter() - started)
    return [sum(times) for times in best]


def model_shapes() -> list[tuple[int, int]]:
    return SMOLLM2_LAYER_SHAPES * SMOLLM2_LAYERS + [SMOLLM2_HEAD]


def crossover_from(times: dict[int, tuple[float, float]]) -> int:
    """The most rows up to which the quantized side wins at every measured count (0: it
    never does; ALL_ROWS: it wins at every count measured, the largest included)."""
    best = 0
    for rows in sorted(times):
        float_s, quantized_s = times[rows]
        if quantized_s >= float_s:
            return best
        best = rows
    return ALL_ROWS if times else 0


def measure_crossover(
    fmt: str,
    dtype: torch.dtype,
    group_size: int,
    rows: Sequence[int],
    repeats: int = 7,
    torch_kernels: bool = False,
) -> tuple[int, dict[int, tuple[float, float]]]:
    """The crossover of `fmt` under `dtype` activations over a whole SmolLM2-135M step's
    products, and the (float, quantized) seconds measured at each row count (in
    increasing order, stopping after the quantized side has lost twice in a row)."""
    torch.manual_seed(0)
    products = build(
        model_shapes(), fmt, group_size, dtype, torch_kernel if torch_kernels else None
    )
    times: dict[int, tuple[float, float]] = {}
    losses = 0
    for r in sorted(rows):
        times[r] = time_rows(products, r, dtype, repeats)
        losses = losses + 1 if times[r][1] >= times[r][0] else 0
        if losses == 2:
            break
    return crossover_from(times), times
