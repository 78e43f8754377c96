"""The integer product of quantized weights (`torch.ops.cadence.quant_matmul`,
`quant_kernels.cpp`): activations quantized to int8 per row and block of 32 columns, int4
or int8 weights, int32 dot products. Each instruction set's library against the same
arithmetic in float32 (`cpu_gemm.reference_product`), and against the plain float product
within what int8 activations cost; every tile shape the vector paths have (AVX-512: 1-4
rows x 1-3 column blocks; AVX2: 1-4 rows x 1-2 blocks; a padded last block), int8 weights
at -128 (what an 8-bit GPTQ checkpoint may hold), the operator's checks and its Meta
implementation."""

from __future__ import annotations

import pytest
import torch
from cadence.quant import cpu_gemm
from cadence.quant.formats import Int4Weight, Int8Weight, QuantizedWeight
from cadence.quant.quantize import quantize_int4, quantize_int8, quantize_int8_blocks
from cadence.shard.backends import product_kernels

# Row counts covering 1..4-row tiles and their tails; widths covering 1..4 column blocks,
# a partial last block, and int8's partial last input block.
ROWS = (1, 2, 3, 4, 5, 8, 11, 33)
INT4_SHAPES = ((40, 96, 32), (200, 128, 64), (16, 256, 128), (72, 64, 32))
INT8_SHAPES = ((40, 100), (200, 128), (16, 33), (72, 576))
INT8_BLOCK_SHAPES = ((40, 96), (200, 64), (72, 576))


def _weight(out: int, inp: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out, inp, generator=g) * 0.1 + torch.linspace(-0.05, 0.05, inp)


def _input(rows: int, inp: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1000)
    x = torch.randn(rows, inp, generator=g)
    x[:, :3] *= 20  # an outlier column, as LLM activations have
    return x


def _weights() -> list[tuple[str, QuantizedWeight]]:
    cases: list[tuple[str, QuantizedWeight]] = []
    for i, (out, inp, group) in enumerate(INT4_SHAPES):
        cases.append((f"int4-{out}x{inp}-g{group}", quantize_int4(_weight(out, inp, i), group)))
    for i, (out, inp) in enumerate(INT8_SHAPES):
        cases.append((f"int8-{out}x{inp}", quantize_int8(_weight(out, inp, 10 + i))))
    for i, (out, inp) in enumerate(INT8_BLOCK_SHAPES):
        weight = quantize_int8_blocks(_weight(out, inp, 20 + i))
        cases.append((f"int8-blocks-{out}x{inp}", weight))
    return cases


WEIGHTS = _weights()


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).abs().max() / want.abs().max())


@pytest.mark.usefixtures("cpu_isa")
@pytest.mark.parametrize(("name", "weight"), WEIGHTS, ids=[n for n, _ in WEIGHTS])
def test_each_library_computes_the_quantized_arithmetic(name, weight):
    kernel = cpu_gemm.IntegerCpuKernel(weight)
    w = weight.dequantize()
    for rows in ROWS:
        x = _input(rows, w.shape[1], rows)
        want = cpu_gemm.reference_product(x, w)
        # float32 in and out: only the order of float32 sums differs
        assert _relative(kernel(x), want) < 2e-6, (name, rows)
        # bfloat16 in and out: the input is exact in float32, the output rounded once
        xb = x.to(torch.bfloat16)
        got = kernel(xb)
        assert got.dtype == torch.bfloat16
        assert _relative(got, cpu_gemm.reference_product(xb.float(), w)) < 2**-8, (name, rows)


@pytest.mark.usefixtures("cpu_isa")
def test_the_input_may_be_a_strided_view_and_a_zero_block_stays_zero():
    weight = quantize_int4(_weight(48, 128, 3), 32)
    kernel = cpu_gemm.IntegerCpuKernel(weight)
    wide = _input(6, 256, 7)
    x = wide[:, ::2]  # rows 256 apart, columns 2 apart
    x[:, 32:64] = 0  # a block of zeros: scale 0, no division by it
    want = cpu_gemm.reference_product(x.contiguous(), weight.dequantize())
    got = kernel(x)
    assert torch.isfinite(got).all()
    assert _relative(got, want) < 2e-6


def _extreme_int8_weight() -> Int8Weight:
    """Random q over the whole int8 range, a channel all -128 and one alternating -128 and
    127: against activations at +-127 its pair products reach 2 * 128 * 127."""
    g = torch.Generator().manual_seed(21)
    q = torch.randint(-128, 128, (40, 100), generator=g, dtype=torch.int8)
    q[0] = -128
    q[1, 0::2], q[1, 1::2] = -128, 127
    return Int8Weight(q, torch.rand(40, generator=g) * 0.01 + 0.001)


@pytest.mark.usefixtures("cpu_isa")
def test_int8_weights_at_minus_128_multiply_exactly():
    weight = _extreme_int8_weight()
    kernel = cpu_gemm.IntegerCpuKernel(weight)
    w = weight.dequantize()
    for rows in ROWS:
        x = _input(rows, w.shape[1], rows)
        x[0] = 1.0  # every activation of the row quantized to 127
        x[-1, 0::2], x[-1, 1::2] = -1.0, 1.0  # -127 and 127 against the alternating channel
        assert _relative(kernel(x), cpu_gemm.reference_product(x, w)) < 2e-6, rows


@pytest.mark.parametrize(("name", "weight"), WEIGHTS, ids=[n for n, _ in WEIGHTS])
def test_int8_activations_stay_within_their_rounding_of_the_float_product(name, weight):
    """Against x @ W.T with no activation quantization: each activation moves by at most
    half a step of its block (amax / 254); with an outlier column 20x the others (which
    sets its block's step) the largest error is 1.0-1.6% of the largest output here
    (bound 3%)."""
    kernel = cpu_gemm.IntegerCpuKernel(weight)
    w = weight.dequantize()
    x = _input(33, w.shape[1], 5)
    assert _relative(kernel(x), x @ w.t()) < 3e-2


def test_act_order_input_columns_are_taken_in_perm_order():
    w = _weight(32, 64, 4)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    base = quantize_int4(w[:, perm], 32)  # q's columns in perm's order
    weight = Int4Weight(base.q, base.scale, base.zero, 32, perm)
    x = _input(5, 64, 9)
    want = cpu_gemm.reference_product(x[:, perm], base.dequantize())
    assert _relative(cpu_gemm.IntegerCpuKernel(weight)(x), want) < 2e-6


def test_what_the_packing_takes():
    assert cpu_gemm.takes(quantize_int8(_weight(8, 40, 0)))
    assert cpu_gemm.takes(quantize_int4(_weight(8, 64, 0), 32))
    odd = Int4Weight(torch.zeros(8, 48, dtype=torch.uint8), torch.ones(8, 3), torch.zeros(8, 3), 16)
    assert not cpu_gemm.takes(odd)
    with pytest.raises(ValueError, match="multiples of 32"):
        cpu_gemm.pack_int4(odd)


def _packed(fmt: str) -> cpu_gemm.PackedWeight:
    if fmt == "int4":
        return cpu_gemm.pack_int4(quantize_int4(_weight(40, 64, 0), 32))
    if fmt == "int8-blocks":
        return cpu_gemm.pack_int8_blocks(quantize_int8_blocks(_weight(40, 64, 0)))
    return cpu_gemm.pack_int8(quantize_int8(_weight(40, 64, 0)))


@pytest.mark.parametrize("fmt", ["int4", "int8", "int8-blocks"])
def test_arguments_are_checked_naming_them(fmt):
    from cadence.kernels import cpu

    if not cpu.available():
        pytest.skip(f"no CPU kernels: {cpu.unavailable_reason()}")
    w = _packed(fmt)
    op = torch.ops.cadence.quant_matmul
    x = torch.randn(3, 64)
    with pytest.raises(ValueError, match="quant_matmul: x must be"):
        op(x[:, :32], w.packed, w.scales, 40, w.fmt)  # another input width
    with pytest.raises(ValueError, match="quant_matmul: x must be float32 or bfloat16"):
        op(x.half(), w.packed, w.scales, 40, w.fmt)
    with pytest.raises(ValueError, match="quant_matmul: packed must be"):
        op(x, w.packed.reshape(-1), w.scales, 40, w.fmt)
    with pytest.raises(ValueError, match="quant_matmul: scales must be"):
        op(x, w.packed, w.scales[..., :1].contiguous(), 40, w.fmt)
    with pytest.raises(ValueError, match="out_features 16 does not fill"):
        op(x, w.packed, w.scales, 16, w.fmt)
    with pytest.raises(ValueError, match="format must be 0"):
        op(x, w.packed, w.scales, 40, 7)
    torch.library.opcheck(op, (x, w.packed, w.scales, 40, w.fmt))


@pytest.mark.parametrize("fmt", ["int4", "int8", "int8-blocks"])
def test_the_meta_implementation_gives_the_output_shape(fmt):
    from cadence.kernels import cpu

    if not cpu.available():
        pytest.skip(f"no CPU kernels: {cpu.unavailable_reason()}")
    w = _packed(fmt)
    y = torch.ops.cadence.quant_matmul(
        torch.empty(5, 64, device="meta"), w.packed.to("meta"), w.scales.to("meta"), 40, w.fmt
    )
    assert y.shape == (5, 40) and y.device.type == "meta"


# The builds whose vector tiles beat torch's kernels (VNNI; AVX2's vpmaddubsw, measured with
# everything held to AVX2 in docs/quantization.md); avx512 and scalar run portable C++.
FAST_INTEGER_PRODUCT = ("avx512_bf16", "avx2")


def test_products_use_the_integer_kernel_where_it_is_fast():
    from cadence.kernels import cpu
    from cadence.quant.product import make_kernel

    if not cpu.available():
        pytest.skip(f"no CPU kernels: {cpu.unavailable_reason()}")
    weights: list[QuantizedWeight] = [
        quantize_int4(_weight(32, 64, 0), 32),
        quantize_int8(_weight(32, 64, 0)),
        quantize_int8_blocks(_weight(32, 64, 0)),
    ]
    for isa in cpu.isa.ISAS:
        assert cpu_gemm.integer_product_is_fast(isa) == (isa in FAST_INTEGER_PRODUCT), isa
    x = _input(3, 64, 0)
    for isa in cpu.isa.supported():
        with cpu.selected(isa):
            for weight in weights:
                products = product_kernels(torch.device("cpu"))  # the selected ISA's
                kernel = make_kernel(weight, torch.float32, torch.device("cpu"), products)
                integer = isinstance(kernel, cpu_gemm.IntegerCpuKernel)
                assert integer == cpu_gemm.integer_product_is_fast(isa), (isa, type(kernel))
                if not integer:  # torch's kernels, or int8 blocks' dequantized weight
                    want = x @ weight.dequantize().t()
                    assert _relative(kernel(x), want) < 1e-2, (isa, type(kernel))


def test_int8_blocks_requantize_to_their_own_bytes():
    """A Q8_0 tensor's dequantized values quantize back to its own blocks exactly (each
    block's largest value is 127 of its scales): a tied table served from its float copy
    multiplies by the file's bytes."""
    g = torch.Generator().manual_seed(3)
    q = torch.randint(-127, 128, (24, 96), generator=g, dtype=torch.int8)
    q[:, ::32] = 127  # every block reaches its scale
    scale = torch.rand(24, 3, generator=g).half().float()  # Q8_0 keeps float16 scales
    blocks = q.float().reshape(24, 3, 32) * scale.unsqueeze(-1)
    again = quantize_int8_blocks(blocks.reshape(24, 96))
    assert torch.equal(again.q, q) and torch.equal(again.scale, scale)
