"""Linears through weights prepacked for oneDNN (`cadence.layers.packed`) give F.linear's
result, and prepacking is only tried where oneDNN can do it and it pays."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cadence.kernels import cpu
from cadence.layers.linear import ColumnParallelLinear
from cadence.layers.packed import linear, onednn_packs, pack_linear_weights, packing_supported

TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=0.06, rtol=0.02)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 32, 64, 65, 300, 320, 321, 1024])
def test_prepacked_linear_matches_f_linear(rows, dtype):
    if not onednn_packs(dtype):
        pytest.skip(f"oneDNN cannot prepack {dtype} on this CPU")
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=g).to(dtype)
    bias = torch.randn(96, generator=g).to(dtype)
    x = torch.randn(rows, 80, generator=g).to(dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 32)
    ours = linear(x, weight, bias, packed)
    torch.testing.assert_close(ours, F.linear(x, weight, bias), **TOLERANCE[dtype])


def test_bfloat16_is_prepacked_only_with_avx512(cpu_isa):
    """With the AVX2 or scalar kernels (a CPU without AVX-512, where oneDNN refuses to
    prepack bfloat16) bfloat16 linears keep F.linear; float32 ones are prepacked wherever
    oneDNN takes them."""
    weight = torch.empty(8, 8, dtype=torch.bfloat16)
    expected = cpu_isa in ("avx512_bf16", "avx512") and onednn_packs(torch.bfloat16)
    assert packing_supported(weight) == expected
    assert packing_supported(weight.float()) == onednn_packs(torch.float32)
    assert cpu.selected_isa() == cpu_isa


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nothing_is_prepacked_with_the_cpu_kernels_off(dtype):
    layer = ColumnParallelLinear(80, 96, bias=False)
    layer.weight.data = torch.randn(96, 80).to(dtype)
    assert pack_linear_weights(layer, enabled=False) == 0
    assert layer.packed_weight is None
    expected = 96 * 80 * layer.weight.element_size() if packing_supported(layer.weight) else 0
    assert pack_linear_weights(layer, enabled=True) == expected
    assert (layer.packed_weight is not None) == (expected > 0)
