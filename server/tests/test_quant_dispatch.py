"""Which path a quantized layer's product takes: the quantized kernel up to the
crossover, the float (prepacked) weight above it when kept, the kernel at every row
count when not; the flat CPU runner's product chooses as the layer does. And the
crossover table: measured entries win over the defaults."""

from __future__ import annotations

import json

import pytest
import torch
from cadence.layers.linear import ColumnParallelLinear, RowParallelLinear
from cadence.layers.packed import linear, pack_linear_weights
from cadence.quant import crossover
from cadence.quant.load import Dispatch, install
from cadence.quant.quantize import quantize_int4, quantize_int8
from cadence.runners.llama_cpu_flat import _linear
from cadence.shard.backends import product_kernels
from torch import nn

CROSSOVER = 4
CPU_PRODUCTS = product_kernels(torch.device("cpu"))  # as a CPU shard chooses


def _layer(fmt: str, keep_float: bool, bias: bool = False) -> ColumnParallelLinear:
    torch.manual_seed(0)
    layer = ColumnParallelLinear(64, 48, bias=bias)
    with torch.no_grad():
        layer.weight.normal_(0, 0.1)
        if bias:
            layer.bias.normal_()
    w = layer.weight.data
    piece = quantize_int8(w) if fmt == "int8" else quantize_int4(w, 32)
    install(layer, [piece], Dispatch(keep_float, CPU_PRODUCTS, {fmt: CROSSOVER}), True, False)
    pack_linear_weights(nn.ModuleList([layer]))
    return layer


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, CROSSOVER, CROSSOVER + 1, 33])
def test_kept_float_serves_the_rows_above_the_crossover(fmt: str, rows: int):
    layer = _layer(fmt, keep_float=True, bias=True)
    x = torch.randn(rows, 64)
    quantized = layer.quantized(x, layer.bias)
    floating = linear(x, layer.weight, layer.bias, layer.packed_weight)
    assert not torch.equal(quantized, floating)  # the two paths are told apart
    expected = quantized if rows <= CROSSOVER else floating
    assert torch.equal(layer(x), expected)
    assert torch.equal(_linear(layer, x), expected)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_without_a_float_copy_every_product_is_quantized(fmt: str):
    layer = _layer(fmt, keep_float=False)
    assert layer.weight.numel() == 0 and layer.packed_weight is None
    for rows in (1, 33, 300):
        x = torch.randn(rows, 64)
        assert torch.equal(layer(x), layer.quantized(x))
        assert torch.equal(_linear(layer, x), layer.quantized(x))


def test_a_row_parallel_layer_adds_its_bias_on_the_quantized_path():
    layer = RowParallelLinear(64, 32, bias=True)
    with torch.no_grad():
        layer.weight.normal_(0, 0.1)
        layer.bias.normal_()
    install(layer, [quantize_int8(layer.weight.data)], Dispatch(False, CPU_PRODUCTS), True, False)
    x = torch.randn(3, 64)
    assert torch.equal(layer(x), layer.quantized(x) + layer.bias)


def test_the_measured_table_wins_over_the_defaults(tmp_path):
    path = tmp_path / crossover.FILE_NAME
    key = ("int8", "bfloat16", "avx512_bf16")
    default = crossover.crossover_rows(*key, path=path)
    assert (default.rows, default.source) == (crossover.DEFAULTS[key], "default")
    crossover.write_table({key: 17}, "some CPU", path)
    crossover.write_table({("int4", "float32", "avx2"): 3}, "some CPU", path)  # merged
    measured = crossover.crossover_rows(*key, path=path)
    assert measured.rows == 17 and str(path) in measured.source
    assert crossover.crossover_rows("int4", "float32", "avx2", path=path).rows == 3
    assert json.loads(path.read_text())["cpu"] == "some CPU"
    unknown = crossover.crossover_rows("int8", "float16", "scalar", path=path)
    assert (unknown.rows, unknown.source) == (crossover.FALLBACK_ROWS, "fallback")


def test_a_float_copy_is_kept_only_where_some_product_reads_it():
    from cadence.quant.crossover import ALL_ROWS

    auto = Dispatch(True, CPU_PRODUCTS, {"int4": ALL_ROWS, "int8": 128})
    assert not auto.keeps_float(["int4 g32"])  # the quantized kernel serves every row count
    assert auto.keeps_float(["int8"])  # prefill chunks over 128 rows read it
    assert auto.keeps_float(["int4 g32", "int8"])  # a fused layer: its slowest format decides
    asked = Dispatch(True, CPU_PRODUCTS, {"int4": ALL_ROWS}, keep_float_always=True)
    assert asked.keeps_float(["int4 g32"])
    assert not Dispatch(False, CPU_PRODUCTS, {"int8": 4}).keeps_float(["int8"])
    layer = _layer("int4", keep_float=True)  # CROSSOVER rows: kept
    assert layer.weight.numel() > 0
    plain = ColumnParallelLinear(64, 48, bias=False)
    with torch.no_grad():
        plain.weight.normal_()
    install(plain, [quantize_int4(plain.weight.data, 32)], auto, True, False)
    assert plain.weight.numel() == 0 and not plain.quantized.float_kept
