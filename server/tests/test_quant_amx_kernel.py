"""The AMX-INT8 product of quantized weights (`torch.ops.cadence.quant_matmul_tiles`,
`quant_amx.h`) against the VNNI product of the same avx512_bf16 kernels
(`quant_matmul`), bit for bit: every weight case and row count of
test_quant_integer_kernel.py, the row counts AMX's 16-row tiles add, a strided input,
extreme values. Emulated tiles (tiles 2: the SDM's definitions, `amx_tiles.h`) wherever
the avx512_bf16 kernels run; the hardware's (tiles 1) where the CPU and Linux allow AMX,
skipped with the reason elsewhere. Also what happens without AMX: a clear error, and the
launcher's self-test (`amx_check.usable`) saying why."""

from __future__ import annotations

import pytest
import torch
from cadence import cpu_isa
from cadence.kernels.cpu import amx_check
from cadence.quant import cpu_gemm
from cadence.quant.formats import Int4Weight, Int8BlockWeight, Int8Weight, QuantizedWeight
from test_quant_integer_kernel import ROWS, WEIGHTS, _input, _weight

HARDWARE, EMULATED = 1, 2
# AMX's tiles take 16 rows: one tile exactly, one and a row, two, three
AMX_ROWS = (*ROWS, 16, 17, 32, 48)


@pytest.fixture(params=[EMULATED, HARDWARE], ids=["emulated", "hardware"])
def tiles(request: pytest.FixtureRequest, avx512_bf16: None) -> int:
    if request.param == HARDWARE:
        request.getfixturevalue("amx_int8_hardware")
    return request.param


def _both(weight: QuantizedWeight, x: torch.Tensor, tiles: int) -> tuple[torch.Tensor, ...]:
    """(the AMX product, the VNNI product) of x and weight."""
    w = cpu_gemm.IntegerCpuKernel(weight).weight
    op = torch.ops.cadence
    got = op.quant_matmul_tiles(x, w.packed, w.scales, w.out_features, w.fmt, tiles)
    want = op.quant_matmul(x, w.packed, w.scales, w.out_features, w.fmt)
    return got, want


@pytest.mark.parametrize(("name", "weight"), WEIGHTS, ids=[n for n, _ in WEIGHTS])
def test_amx_gives_the_vnni_products_bits(name, weight, tiles):
    for rows in AMX_ROWS:
        x = _input(rows, weight.shape[1], rows)
        for dtype in (torch.float32, torch.bfloat16):
            got, want = _both(weight, x.to(dtype), tiles)
            assert got.dtype == dtype and got.shape == want.shape
            assert torch.equal(got, want), (name, rows, dtype)


def test_the_shards_integer_product_serves_on_the_tiles_chosen_for_its_format(tiles):
    """cpu_gemm.use_tiles routes a format's products (int8 GGUF blocks with int8) to the
    chosen tiles; the other format's stay on the vector tiles."""
    int4, int8 = (w for name, w in WEIGHTS if name.startswith("int4")), dict(WEIGHTS)
    kernels = [
        cpu_gemm.IntegerCpuKernel(next(int4)),
        *map(cpu_gemm.IntegerCpuKernel, (int8["int8-72x576"], int8["int8-blocks-72x576"])),
    ]
    x = {k: _input(33, k.weight.in_features, 3).to(torch.bfloat16) for k in kernels}
    want = [k(x[k]) for k in kernels]
    try:
        cpu_gemm.use_tiles("int8", tiles)
        assert cpu_gemm.tiles_of("int8") == tiles and cpu_gemm.tiles_of("int4") == 0
        for k, expected in zip(kernels, want, strict=True):
            assert torch.equal(k(x[k]), expected)
        cpu_gemm.use_tiles("int4", tiles)
        assert torch.equal(kernels[0](x[kernels[0]]), want[0])
    finally:
        cpu_gemm.use_tiles("int4", cpu_gemm.VECTOR_TILES)
        cpu_gemm.use_tiles("int8", cpu_gemm.VECTOR_TILES)


def test_a_strided_input_and_a_zero_block(tiles):
    weight = Int4Weight(*_int4_parts(48, 128), 32)
    wide = _input(20, 256, 7)
    x = wide[:, ::2]  # rows 256 apart, columns 2 apart
    x[:, 32:64] = 0  # a block of zeros: scale 0
    got, want = _both(weight, x, tiles)
    assert torch.isfinite(got).all()
    assert torch.equal(got, want)


def _int4_parts(out: int, inp: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from cadence.quant.quantize import quantize_int4

    base = quantize_int4(_weight(out, inp, 3), 32)
    return base.q, base.scale, base.zero


def _signs(rows: int, k: int, seed: int) -> torch.Tensor:
    """+-1 activations: every block's amax is 1, so each quantizes to +-127 (the int8
    quantizer's extremes; -128 it never makes). The first row all +1, the last alternating."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 2, (rows, k), generator=g).float() * 2 - 1
    x[0] = 1.0
    x[-1, 0::2], x[-1, 1::2] = -1.0, 1.0
    return x


def test_extreme_values_over_1024_inputs(tiles):
    """Weights at the ends of their ranges (int8 q -128 and 127: bytes 0 and 255; int4 q 0
    and 15) against activations at +-127, over 32 blocks of 32 inputs: every product at its
    largest magnitude, the signed x unsigned extension of each byte exercised."""
    g = torch.Generator().manual_seed(5)
    k = 1024
    ends = torch.randint(0, 2, (40, k), generator=g, dtype=torch.bool)
    ends[0], ends[1, 0::2], ends[1, 1::2] = True, True, False
    q8 = torch.where(ends, 127, -128).to(torch.int8)
    scale = torch.rand(40, generator=g) * 0.01 + 0.001
    weights: list[QuantizedWeight] = [
        Int8Weight(q8, scale),
        Int8BlockWeight(q8, torch.rand(40, k // 32, generator=g) * 0.01 + 0.001),
        Int4Weight(
            torch.where(ends, 15, 0).to(torch.uint8),
            torch.rand(40, k // 32, generator=g) * 0.01 + 0.001,
            torch.rand(40, k // 32, generator=g) * 0.01,
            32,
        ),
    ]
    for weight in weights:
        for rows in (1, 16, 33):
            x = _signs(rows, k, rows)
            got, want = _both(weight, x, tiles)
            assert torch.equal(got, want), (type(weight).__name__, rows)
            # and the quantized arithmetic itself (the activations are exact: +-1 = +-127 d)
            reference = cpu_gemm.reference_product(x, weight.dequantize())
            assert float((got - reference).abs().max() / reference.abs().max()) < 2e-6


def test_the_operator_checks_its_arguments_and_traces(avx512_bf16):
    w = cpu_gemm.pack_int4(Int4Weight(*_int4_parts(40, 64), 32))
    op = torch.ops.cadence.quant_matmul_tiles
    x = torch.randn(3, 64)
    with pytest.raises(ValueError, match="quant_matmul_tiles: tiles must be 1 .* or 2"):
        op(x, w.packed, w.scales, 40, w.fmt, 3)
    with pytest.raises(ValueError, match="quant_matmul_tiles: x must be"):
        op(x[:, :32], w.packed, w.scales, 40, w.fmt, EMULATED)
    with pytest.raises(ValueError, match="out_features 16 does not fill"):
        op(x, w.packed, w.scales, 16, w.fmt, EMULATED)
    torch.library.opcheck(op, (x, w.packed, w.scales, 40, w.fmt, EMULATED))
    y = op(torch.empty(5, 64, device="meta"), w.packed.to("meta"), w.scales.to("meta"), 40, 0, 2)
    assert y.shape == (5, 40) and y.device.type == "meta"
    assert op(x[:0], w.packed, w.scales, 40, w.fmt, EMULATED).shape == (0, 40)


def test_hardware_tiles_without_amx_are_an_error_not_a_crash(avx512_bf16):
    if torch.ops.cadence.amx_available():
        pytest.skip("this CPU and Linux allow AMX: the hardware tiles run")
    w = cpu_gemm.pack_int8(Int8Weight(torch.ones(16, 32, dtype=torch.int8), torch.ones(16)))
    for rows in (3, 0):
        with pytest.raises(RuntimeError, match="AMX is not usable in this process"):
            torch.ops.cadence.quant_matmul_tiles(
                torch.randn(rows, 32), w.packed, w.scales, 16, w.fmt, HARDWARE
            )


def test_only_the_avx512_bf16_kernels_have_the_amx_product():
    from cadence.kernels import cpu

    if not cpu.available():
        pytest.skip(f"no CPU kernels: {cpu.unavailable_reason()}")
    w = cpu_gemm.pack_int8(Int8Weight(torch.ones(16, 32, dtype=torch.int8), torch.ones(16)))
    others = [isa for isa in cpu_isa.supported() if isa != amx_check.ISA]
    if not others:
        pytest.skip("this CPU runs no kernels but avx512_bf16's")
    for isa in others:
        with cpu.selected(isa):
            assert not torch.ops.cadence.amx_available(), isa
            for tiles in (HARDWARE, EMULATED):
                with pytest.raises(RuntimeError, match="no AMX kernel"):
                    torch.ops.cadence.quant_matmul_tiles(
                        torch.randn(2, 32), w.packed, w.scales, 16, w.fmt, tiles
                    )


def test_the_launchers_self_test():
    if not amx_check.AMX_FLAGS <= cpu_isa.cpu_flags():
        ok, reason = amx_check.usable()  # from /proc/cpuinfo, no process spawned
        assert not ok and "AMX" in reason, reason
        return
    from cadence.kernels import cpu

    if cpu_isa.missing(amx_check.ISA) or not cpu.available():
        pytest.skip("AMX without the avx512_bf16 kernels: the self-test's reason is theirs")
    with cpu.selected(amx_check.ISA):
        expected = torch.ops.cadence.amx_available()
    ok, reason = amx_check.usable(timeout_s=600)  # its own process, as the launcher runs it
    assert ok == expected and "AMX" in reason, reason
