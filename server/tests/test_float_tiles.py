"""cadence's float32 product on prepacked weights (`torch.ops.cadence.float_matmul`,
float_kernels.cpp): each library against the float64 product within float32's rounding,
every library the portable loop's bits (each output one FMA chain over the input columns in
order), and a row's bits the same whatever else is in the call -- every tile shape (1-6
rows, 1-4 panels, a partial last panel), both paths (rows read in place, and copied into
strips from LARGE rows on); and the layers that serve through it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cadence.kernels import cpu
from cadence.layers.linear import ColumnParallelLinear
from cadence.layers.packed import (
    float_tiles_serve,
    is_tile_packing,
    pack_linear_weights,
    tile_packing,
)

if not cpu.available():
    pytest.skip(f"no CPU kernels: {cpu.unavailable_reason()}", allow_module_level=True)

LARGE = 160  # float_kernels.cpp: rows from which x is copied into strips
ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 11, 33, LARGE - 1, LARGE, 173)
# (out, in): partial last panels (40, 200, 33), a single panel (16), one and several
# 64-column tiles (72, 200); an input width that is no multiple of anything (33, 100)
SHAPES = ((40, 72), (200, 100), (16, 33), (72, 576), (33, 64))


def _weight(out: int, inp: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out, inp, generator=g) * 0.1


def _input(rows: int, inp: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1000)
    return torch.randn(rows, inp, generator=g)


def _product(x: torch.Tensor, w: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.cadence.float_matmul(x, packed, None, w.shape[0])


@pytest.mark.usefixtures("cpu_isa")
@pytest.mark.parametrize(("out", "inp"), SHAPES)
def test_each_library_multiplies_within_float32_rounding(out: int, inp: int) -> None:
    w = _weight(out, inp, out)
    packed = tile_packing(w)
    for rows in ROWS:
        x = _input(rows, inp, rows)
        want = x.double() @ w.double().T
        got = _product(x, w, packed)
        assert got.dtype == torch.float32 and got.shape == (rows, out)
        # float32 sums of `inp` products: a few units in the last place of the largest
        assert float((got - want).abs().max() / want.abs().max()) < 4e-6, (rows, out, inp)


@pytest.mark.usefixtures("cpu_isa")
@pytest.mark.parametrize(("out", "inp"), SHAPES)
def test_every_library_gives_the_portable_loops_bits(out: int, inp: int) -> None:
    w = _weight(out, inp, out)
    packed = tile_packing(w)
    x = _input(max(ROWS), inp, 7)
    got = {rows: _product(x[:rows], w, packed) for rows in ROWS}
    with cpu.selected("scalar"):
        for rows, mine in got.items():
            assert torch.equal(mine, _product(x[:rows], w, packed)), rows


@pytest.mark.usefixtures("cpu_isa")
@pytest.mark.parametrize(("out", "inp"), SHAPES)
def test_a_rows_bits_do_not_depend_on_the_other_rows(out: int, inp: int) -> None:
    w = _weight(out, inp, out)
    packed = tile_packing(w)
    x = _input(2 * LARGE + 20, inp, 3)
    whole = _product(x, w, packed)  # the strips' path
    for rows in ROWS:
        for start in (0, 5, x.shape[0] - rows):
            part = _product(x[start : start + rows], w, packed)
            assert torch.equal(part, whole[start : start + rows]), (rows, start)
    # a strided view (every other row) reads the same rows' bits
    assert torch.equal(_product(x[::2], w, packed), whole[::2])


def test_a_bias_is_added_to_each_row() -> None:
    w, bias = _weight(40, 72, 1), torch.randn(40)
    x = _input(5, 72, 1)
    packed = tile_packing(w)
    got = torch.ops.cadence.float_matmul(x, packed, bias, 40)
    assert torch.equal(got, _product(x, w, packed) + bias)


def test_the_packing_puts_16_output_columns_side_by_side() -> None:
    w = torch.arange(40 * 3, dtype=torch.float32).view(40, 3)
    packed = tile_packing(w)
    assert packed.shape == (3, 3, 16) and packed.is_contiguous()
    assert packed[1, 2, 5] == w[16 + 5, 2]
    assert torch.equal(packed[2, :, 8:], torch.zeros(3, 8))  # past the 40 outputs


@pytest.mark.parametrize("isa", ["avx2", "scalar"])
def test_float32_layers_serve_through_the_tiles_with_the_avx2_kernels(isa: str) -> None:
    """With the avx2 kernels a float32 layer is packed for the tiles and multiplies within
    float32 rounding of F.linear; with the others it keeps oneDNN's packing (the tiles were
    measured against oneDNN on AVX2 only)."""
    if cpu.not_selectable(isa):
        pytest.skip(cpu.not_selectable(isa))
    with cpu.selected(isa):
        layer = ColumnParallelLinear(80, 100, bias=True)
        layer.weight.data = torch.randn(100, 80)
        layer.bias.data = torch.randn(100)
        added = pack_linear_weights(layer)
        tiles = is_tile_packing(layer.packed_weight)
        assert tiles == float_tiles_serve() == (isa == "avx2")
        if tiles:
            assert added == 7 * 16 * 80 * 4  # 100 outputs in 7 panels of 16
        x = torch.randn(9, 80)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
