"""The quantizers and the CPU quantized products: each kernel against dequantize-then-
matmul in float32, for both formats, float32 and bfloat16 activations (the kernels run
in bfloat16 and answer in the input's dtype), 1 to 33 rows, an output width the int4
packing must pad, and GPTQ's act-order column order."""

from __future__ import annotations

import pytest
import torch
from cadence.quant.cpu_kernels import Int4CpuKernel, Int8CpuKernel
from cadence.quant.formats import Int4Weight
from cadence.quant.quantize import group_size_for, quantize_int4, quantize_int8

OUT, IN, GROUP = 40, 128, 32  # 40 output rows: not a multiple of the int4 packing's 16
# Kernel vs reference, relative to the output's largest magnitude: the kernels run in
# bfloat16 (a float32 input is rounded to it), with bfloat16 scales and zeros.
TOLERANCE = 1e-2


def _weight(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(OUT, IN, generator=g) * 0.1 + torch.linspace(-0.05, 0.05, IN)


def test_int8_is_symmetric_per_channel_within_half_a_step():
    w = _weight()
    q = quantize_int8(w)
    assert q.q.dtype == torch.int8 and q.scale.shape == (OUT,)
    assert (q.q.abs().amax(dim=1) == 127).all()  # each row's largest value uses the range
    err = (q.dequantize() - w).abs()
    assert (err <= q.scale.unsqueeze(1) / 2 * (1 + 1e-5)).all()
    assert torch.equal(quantize_int8(-w).q, -q.q)


def test_int4_maps_each_group_min_and_max_onto_the_end_levels():
    w = _weight()
    q = quantize_int4(w, GROUP)
    assert q.scale.shape == q.zero.shape == (OUT, IN // GROUP)
    assert int(q.q.min()) == 0 and int(q.q.max()) == 15
    deq = q.dequantize().reshape(OUT, -1, GROUP)
    groups = w.reshape(OUT, -1, GROUP)
    torch.testing.assert_close(deq.amin(-1), groups.amin(-1), atol=1e-6, rtol=0)
    torch.testing.assert_close(deq.amax(-1), groups.amax(-1), atol=1e-6, rtol=0)
    err = (deq - groups).abs()
    assert (err <= q.scale.unsqueeze(-1) / 2 * (1 + 1e-5)).all()


def test_a_constant_group_quantizes_exactly():
    w = torch.full((16, 64), 0.25)
    torch.testing.assert_close(quantize_int4(w, 32).dequantize(), w, atol=1e-6, rtol=0)
    assert torch.equal(quantize_int8(torch.zeros(16, 64)).dequantize(), torch.zeros(16, 64))


def test_group_size_falls_back_to_a_divisor_of_the_input():
    assert group_size_for(1536, 128) == 128
    assert group_size_for(576, 128) == 64  # SmolLM2's hidden size
    assert group_size_for(96, 64) == 32
    with pytest.raises(ValueError, match="no int4 group"):
        group_size_for(48, 128)


def _act_order(w: torch.Tensor, seed: int) -> Int4Weight:
    """`w` quantized GPTQ act-order style: columns taken in a random order `perm`."""
    perm = torch.randperm(IN, generator=torch.Generator().manual_seed(seed))
    q = quantize_int4(w[:, perm], GROUP)
    q.perm = perm
    return q


@pytest.mark.parametrize("rows", [1, 4, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["int8", "int4", "int4_act_order"])
def test_cpu_kernel_matches_dequantize_then_matmul(kind: str, dtype: torch.dtype, rows: int):
    w = _weight(rows)
    if kind == "int8":
        weight = quantize_int8(w)
        kernel = Int8CpuKernel(weight)
    else:
        weight = _act_order(w, rows) if kind == "int4_act_order" else quantize_int4(w, GROUP)
        kernel = Int4CpuKernel(weight)
    x = torch.randn(rows, IN, generator=torch.Generator().manual_seed(7)).to(dtype)
    expected = x.float() @ weight.dequantize().t()
    got = kernel(x)
    assert got.dtype == dtype and got.shape == (rows, OUT)
    scale = float(expected.abs().max())
    torch.testing.assert_close(got.float(), expected, atol=TOLERANCE * scale, rtol=0)
    # a leading batch dimension is flattened and restored
    torch.testing.assert_close(kernel(x.view(1, rows, IN))[0], got, atol=0, rtol=0)


def test_act_order_is_not_the_identity_order():
    """The act-order case above would pass with the perm ignored only if the perm did
    nothing: ignoring it changes the product."""
    weight = _act_order(_weight(), 3)
    x = torch.randn(4, IN)
    with_perm = Int4CpuKernel(weight)(x)
    weight.perm = None
    without = Int4CpuKernel(weight)(x)
    assert (with_perm - without).abs().max() > 0.1 * with_perm.abs().max()


@pytest.mark.parametrize("in_features", [24, 40, 72])
def test_int8_kernel_takes_any_input_width(in_features: int):
    """Widths that are not a multiple of 16 (a tensor-parallel slice of a small model)."""
    w = torch.randn(24, in_features) * 0.1
    weight = quantize_int8(w)
    x = torch.randn(64, in_features)
    expected = x.to(torch.bfloat16).float() @ weight.dequantize().t()
    got = Int8CpuKernel(weight)(x)
    scale = float(expected.abs().max())
    torch.testing.assert_close(got, expected, atol=TOLERANCE * scale, rtol=0)


@pytest.mark.parametrize("group_size", [256, 512])
def test_int4_kernel_splits_groups_larger_than_it_takes(group_size: int):
    """A group of a whole 512-wide row (GPTQ without groups) runs as 256-wide groups
    sharing their scale and zero."""
    w = torch.randn(32, 512) * 0.1
    weight = quantize_int4(w, group_size)
    x = torch.randn(3, 512)
    expected = x.to(torch.bfloat16).float() @ weight.dequantize().t()
    scale = float(expected.abs().max())
    got = Int4CpuKernel(weight)(x)
    torch.testing.assert_close(got, expected, atol=TOLERANCE * scale, rtol=0)
    with pytest.raises(ValueError, match="multiples of 32"):
        Int4CpuKernel(quantize_int4(w, 16))
