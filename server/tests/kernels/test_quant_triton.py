"""The Triton quantized products (`cadence.quant.triton_kernels`) against
dequantize-then-matmul: int8 and int4 (groups 32 and 128, act-order on and off), float32,
bfloat16 and float16 activations, 1 to 33 rows, widths that are not tile multiples.
Under `TRITON_INTERPRET=1` (set by the conftest) without a GPU."""

from __future__ import annotations

import pytest
import torch
from cadence.quant.quantize import quantize_int4, quantize_int8
from cadence.quant.triton_kernels import kernel_for, pack_int4
from kernel_cases import DEVICE

# relative to the output's largest magnitude: float32 order of summation; half precision
# rounds the activations and the dequantized tile before the dot
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def test_pack_int4_puts_even_columns_in_the_low_nibble():
    q = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    assert pack_int4(q).tolist() == [[1 | 2 << 4, 15]]


@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["int8", "int4_g32", "int4_g128", "int4_g32_act_order"])
def test_triton_kernel_matches_dequantize_then_matmul(kind: str, dtype: torch.dtype, rows: int):
    g = torch.Generator().manual_seed(rows)
    out_features, in_features = 72, 256  # 72: a partial output tile
    w = torch.randn(out_features, in_features, generator=g) * 0.1
    if kind == "int8":
        weight = quantize_int8(w)
    else:
        group = 128 if kind == "int4_g128" else 32
        perm = None
        if kind.endswith("act_order"):
            perm = torch.randperm(in_features, generator=g)
            w = w[:, perm]
        weight = quantize_int4(w, group)
        weight.perm = perm
    kernel = kernel_for(weight, dtype, torch.device(DEVICE))
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    expected = x.float() @ weight.dequantize().t()
    got = kernel(x.to(DEVICE)).cpu()
    assert got.dtype == dtype and got.shape == (rows, out_features)
    scale = float(expected.abs().max())
    torch.testing.assert_close(got.float(), expected, atol=TOLERANCE[dtype] * scale, rtol=0)
