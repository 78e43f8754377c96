"""The bfloat16 product on AMX-BF16 tiles (`torch.ops.cadence.bf16_matmul_tiles`,
bf16_kernels.cpp) against float32's product of the same bfloat16 values: within a bfloat16
rounding of the result plus float32's rounding of the sums, every row the same bits
whatever the other rows (the batch invariance it is chosen for), the packing's layout, and
a shard serving bfloat16 weights through it where the kernel table chose it. Emulated tiles
(tiles 2, `amx_tiles.h`) wherever the avx512_bf16 kernels run; the hardware's (tiles 1)
where the CPU and Linux allow AMX-BF16, skipped with the reason elsewhere.

The emulation follows the SDM's pseudo-code (each pair's products added to the float32
sum in turn); a Sapphire Rapids sums a tile row's products in another order, so the two
agree to float32's rounding, not bit for bit, and neither is held to the other's bits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cadence.kernels.cpu import amx_check
from cadence.layers import packed as packing
from cadence.quant import calibrate, float_calibrate
from cadence.quant.float_calibrate import FloatMeasured

HARDWARE, EMULATED = 1, 2
ROWS = (1, 2, 15, 16, 17, 32, 33, 70)  # a tile and a row, two tiles, a padded third
SHAPES = ((40, 96), (40, 100), (16, 32), (96, 576))  # (out, in): tails of 16 and 32


@pytest.fixture(scope="module")
def hardware_tiles(avx512_bf16: None) -> None:
    """AMX's instructions run in this process only once the self-test has run them in a
    process of its own (a CPU or hypervisor that mishandles AMX kills that one)."""
    if not torch.ops.cadence.amx_bf16_available():
        pytest.skip("this CPU has no AMX-BF16, or the kernel refused AMX permission")
    ok, why = amx_check.usable(timeout_s=600)
    if not ok:
        pytest.fail(f"this CPU grants AMX-BF16 but the AMX products fail their self-test: {why}")


@pytest.fixture(params=[EMULATED, HARDWARE], ids=["emulated", "hardware"])
def tiles(request: pytest.FixtureRequest, avx512_bf16: None) -> int:
    if request.param == HARDWARE:
        request.getfixturevalue("hardware_tiles")
    return request.param


def _case(out_features: int, in_features: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g).to(torch.bfloat16)
    x = torch.randn(max(ROWS), in_features, generator=g).to(torch.bfloat16)
    return w, x


def _within_rounding(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """`got` is float32's x @ w.T up to bfloat16's rounding of it (half an ulp: 2^-9 of it)
    and float32's of the sums (k additions of 2^-24 each, of at most the sum of |x w|)."""
    want = x.float() @ w.float().T
    magnitudes = x.float().abs() @ w.float().abs().T
    bound = want.abs() * 2**-8 + magnitudes * x.shape[1] * 2**-23
    off = (got.float() - want).abs()
    assert bool((off <= bound).all()), float((off - bound).max())


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_the_product_is_float32s_within_rounding_and_rows_are_alike_at_any_count(shape, tiles):
    w, x = _case(*shape)
    packed = packing.amx_bf16_packing(w)
    whole = torch.ops.cadence.bf16_matmul_tiles(x, packed, None, shape[0], tiles)
    assert whole.dtype == torch.bfloat16 and whole.shape == (len(x), shape[0])
    _within_rounding(whole, x, w)
    for rows in ROWS:
        for start in (0, 3):
            part = torch.ops.cadence.bf16_matmul_tiles(
                x[start : start + rows], packed, None, shape[0], tiles
            )
            assert torch.equal(part, whole[start : start + rows]), (rows, start)


def test_a_bias_a_strided_input_and_zero_rows(tiles):
    w, x = _case(40, 64, seed=1)
    # the same values, every other column of a wider tensor
    wide = torch.stack([x, torch.zeros_like(x)], dim=2).view(len(x), -1)[:, ::2]
    bias = torch.randn(40).to(torch.bfloat16)
    packed = packing.amx_bf16_packing(w)
    plain = torch.ops.cadence.bf16_matmul_tiles(x, packed, None, 40, tiles)
    strided = torch.ops.cadence.bf16_matmul_tiles(wide, packed, bias, 40, tiles)
    assert torch.equal(strided, plain + bias)
    empty = torch.ops.cadence.bf16_matmul_tiles(x[:0], packed, None, 40, tiles)
    assert empty.shape == (0, 40)


def test_the_packing_holds_each_weight_where_the_tiles_read_it():
    """Tile (b, k) row p holds channel 16 b + c's inputs 32 k + 2p, 32 k + 2p + 1 at 2c, 2c + 1;
    zero past the weight."""
    out_features, in_features = 40, 70
    w = torch.arange(out_features * in_features, dtype=torch.float32).view(out_features, -1)
    packed = packing.amx_bf16_packing(w.to(torch.bfloat16))
    assert packed.shape == (3, 3, 16, 32) and packed.dtype == torch.bfloat16
    for b, k, p, c, i in ((0, 0, 0, 0, 1), (1, 2, 2, 7, 0), (2, 1, 15, 7, 1)):
        assert packed[b, k, p, 2 * c + i] == w[16 * b + c, 32 * k + 2 * p + i].bfloat16()
    assert not packed[2, :, :, 16:].any()  # channels 40..47
    assert not packed[:, 2, 3:, :].any()  # inputs 70..95


def test_the_operator_checks_its_arguments(avx512_bf16):
    w, x = _case(40, 96)
    packed = packing.amx_bf16_packing(w)
    op = torch.ops.cadence.bf16_matmul_tiles
    with pytest.raises(ValueError, match="x"):
        op(x.float(), packed, None, 40, EMULATED)
    with pytest.raises(ValueError, match="out_features"):
        op(x, packed, None, 60, EMULATED)
    with pytest.raises(ValueError, match="x"):
        op(x[:, :60], packed, None, 40, EMULATED)  # not within the packed 3 blocks of 32
    with pytest.raises(ValueError, match="tiles"):
        op(x, packed, None, 40, 0)
    with pytest.raises(ValueError, match="bias"):
        op(x, packed, torch.zeros(40), 40, EMULATED)


def test_hardware_tiles_without_amx_bf16_are_an_error_not_a_crash(avx512_bf16):
    if torch.ops.cadence.amx_bf16_available():
        pytest.skip("this process may run AMX-BF16 (the hardware cases run instead)")
    w, x = _case(40, 96)
    with pytest.raises(RuntimeError, match="AMX is not usable"):
        torch.ops.cadence.bf16_matmul_tiles(x, packing.amx_bf16_packing(w), None, 40, HARDWARE)


def test_only_the_avx512_bf16_kernels_have_the_product():
    from cadence import cpu_isa
    from cadence.kernels import cpu

    w, x = _case(40, 96)
    packed = packing.amx_bf16_packing(w)
    others = [isa for isa in cpu_isa.supported() if isa not in ("avx512_bf16", "scalar")]
    if not others:
        pytest.skip("no other kernels with a C++ build run on this CPU")
    for isa in others:
        with cpu.selected(isa):
            assert not torch.ops.cadence.amx_bf16_available()
            with pytest.raises(RuntimeError, match="no AMX kernel"):
                torch.ops.cadence.bf16_matmul_tiles(x, packed, None, 40, EMULATED)


def test_a_table_choosing_amx_bf16_serves_bfloat16_weights_on_the_tiles_only_where_it_may(
    avx512_bf16, model_dirs, engine_for, tmp_path: Path
) -> None:
    """A bfloat16 model with the table choosing the AMX-BF16 tiles: its products packed for
    them where this process may run AMX-BF16 (oneDNN elsewhere, the same model), batch
    invariance on, the logits float32's within bfloat16 rounding of oneDNN's."""
    from shard_helpers import prefill_then_decode_logits

    tokens = [5, 17, 42, 9, 77, 3, 120, 64, 8, 33]
    model_dir = model_dirs("llama_gqa")
    plain = engine_for(model_dir, dtype="bfloat16")
    assert packing.bf16_product_choice() is None
    seconds = {calibrate.DECODE_ROWS: 1.0, calibrate.PREFILL_ROWS: 1.0}
    key = calibrate.machine_key(amx_check.ISA, "bfloat16")
    entry = FloatMeasured(float_calibrate.AMX_BF16, seconds, seconds, "now")
    path = tmp_path / "table.json"
    calibrate.write(calibrate.KernelTable(key, bf16=entry), path)
    try:
        amx = engine_for(model_dir, dtype="bfloat16", kernel_table=str(path))
        qkv = amx.model.model.layers[0].self_attn.qkv_proj
        assert packing.is_amx_packing(qkv.packed_weight) == packing.amx_bf16_usable()
        assert amx.determinism.on, amx.determinism.detail
        if packing.amx_bf16_usable():
            assert "AMX-BF16 tiles" in amx.kernels["products"], amx.kernels
            assert (qkv.min_rows, qkv.max_rows) == (1, 1024)  # no split: alike by construction
        got = prefill_then_decode_logits(amx, tokens, 4).float()
        want = prefill_then_decode_logits(plain, tokens, 4).float()
        assert torch.allclose(got, want, atol=0.1, rtol=0.02), float((got - want).abs().max())
    finally:
        packing.use_bf16_product(None)


SWIGLU_SHAPES = ((16, 32), (48, 100), (1536, 576))  # (inter, hidden): one block, a k tail, SmolLM2


@pytest.mark.parametrize("shape", SWIGLU_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_the_fused_swiglu_is_the_product_then_silu_mul_bit_for_bit(shape, tiles):
    """bf16_matmul_tiles_swiglu against its two steps: the gate/up product on the same tiles,
    then silu_mul, at row counts of one tile, a tail and several row groups."""
    inter, hidden = shape
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(2 * inter, hidden, generator=g) * 0.1).to(torch.bfloat16)
    packed = packing.amx_bf16_packing(w)
    for rows in (1, 16, 17, 33, 70):
        x = (torch.randn(rows, hidden, generator=g) * 3).to(torch.bfloat16)
        product = torch.ops.cadence.bf16_matmul_tiles(x, packed, None, 2 * inter, tiles)
        want = torch.ops.cadence.silu_mul(product)
        got = torch.ops.cadence.bf16_matmul_tiles_swiglu(x, packed, inter, tiles)
        assert got.shape == (rows, inter) and torch.equal(got, want), rows


def test_the_fused_swiglu_checks_its_arguments(avx512_bf16):
    w, x = _case(64, 96)
    packed = packing.amx_bf16_packing(w)
    op = torch.ops.cadence.bf16_matmul_tiles_swiglu
    with pytest.raises(ValueError, match="inter must be a positive multiple of 16"):
        op(x, packed, 24, EMULATED)
    with pytest.raises(ValueError, match="out_features 32 does not fill"):
        op(x, packed, 16, EMULATED)  # 64 channels: 4 blocks hold 2 x 32, not 2 x 16
    assert op(x, packed, 32, EMULATED).shape == (len(x), 32)
    with pytest.raises(ValueError, match="x"):
        op(x.float(), packed, 32, EMULATED)
    with pytest.raises(ValueError, match="tiles"):
        op(x, packed, 32, 0)


def test_the_flat_step_fuses_swiglu_on_the_tiles_with_the_unfused_bits(
    avx512_bf16, hardware_tiles, model_dirs, engine_for, tmp_path: Path, monkeypatch
) -> None:
    """A bfloat16 Llama whose products the table puts on the AMX-BF16 tiles: every layer's
    SwiGLU runs in its gate/up product's call, and the logits are those of the same engine
    with the fusion off, bit for bit."""
    from cadence.runners import llama_cpu_flat
    from shard_helpers import prefill_then_decode_logits

    tokens = [5, 17, 42, 9, 77, 3, 120, 64, 8, 33]
    seconds = {calibrate.DECODE_ROWS: 1.0, calibrate.PREFILL_ROWS: 1.0}
    key = calibrate.machine_key(amx_check.ISA, "bfloat16")
    entry = FloatMeasured(float_calibrate.AMX_BF16, seconds, seconds, "now")
    path = tmp_path / "table.json"
    calibrate.write(calibrate.KernelTable(key, bf16=entry), path)
    fused_calls: list[int] = []
    original = llama_cpu_flat._fused_swiglu

    def counted(layer, x):
        y = original(layer, x)
        fused_calls.append(y is not None)
        return y

    try:
        model_dir = model_dirs("llama_gqa")
        engines = [engine_for(model_dir, dtype="bfloat16", kernel_table=str(path)) for _ in "ab"]
        # the per-layer loop's fusion (not the one call of a step's layers, which has its own)
        monkeypatch.setattr(llama_cpu_flat, "_layer_stack", lambda model, rows, dtype: None)
        monkeypatch.setattr(llama_cpu_flat, "_fused_swiglu", counted)
        fused = prefill_then_decode_logits(engines[0], tokens, 4)
        assert fused_calls and all(fused_calls), fused_calls
        monkeypatch.setattr(llama_cpu_flat, "_fused_swiglu", lambda layer, x: None)
        unfused = prefill_then_decode_logits(engines[1], tokens, 4)
        assert torch.equal(fused, unfused), float((fused.float() - unfused.float()).abs().max())
    finally:
        packing.use_bf16_product(None)
