"""Which float32 product serves, measured on the machine (`cadence.quant.float_calibrate`):
cadence's tiles or oneDNN's prepacked product, chosen with a margin for the side that is
not the instruction set's default, kept in the kernel table, and served by a shard that
is handed the table."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from cadence.config import LaunchConfig
from cadence.kernels import cpu as cpu_kernels
from cadence.launcher import needs_measuring, with_kernel_table
from cadence.layers import packed as packing
from cadence.quant import calibrate, float_calibrate
from cadence.quant.float_calibrate import FloatMeasured
from shard_helpers import prefill_then_decode_logits

TOKENS = [5, 17, 9, 33, 2, 48, 11, 7, 21, 30, 4, 8]
ROWS = (calibrate.DECODE_ROWS, calibrate.PREFILL_ROWS)


def isa_with_tiles() -> str:
    isa = cpu_kernels.select("auto")
    if isa not in float_calibrate.TILE_ISAS or not float_calibrate.can_measure(isa):
        pytest.skip(f"the {isa} kernels and this CPU's oneDNN cannot both serve float32")
    return isa


def test_the_side_that_is_not_the_default_must_win_by_the_margin() -> None:
    assert packing.default_float_product("avx2") == float_calibrate.TILES
    for isa in ("avx512", "avx512_bf16"):
        assert packing.default_float_product(isa) == float_calibrate.ONEDNN
    close, clear = 1.0 / 0.97, 1.0 / 0.9  # the default's time when the other takes 1.0
    assert float_calibrate.choose("avx2", tiles=close, onednn=1.0) == float_calibrate.TILES
    assert float_calibrate.choose("avx2", tiles=clear, onednn=1.0) == float_calibrate.ONEDNN
    assert float_calibrate.choose("avx2", tiles=1.0, onednn=2.0) == float_calibrate.TILES
    assert float_calibrate.choose("avx512_bf16", tiles=1.0, onednn=close) == "onednn"
    assert float_calibrate.choose("avx512_bf16", tiles=1.0, onednn=clear) == "tiles"
    assert float_calibrate.choose("avx512_bf16", tiles=2.0, onednn=1.0) == "onednn"


def test_the_measurement_times_both_sides_and_is_kept_per_machine(tmp_path: Path) -> None:
    isa = isa_with_tiles()
    measured = calibrate.measure(
        isa, "float32", shapes=[(64, 128), (128, 64)], formats=("int8",), kv_step=(4, 40, 32)
    )
    m = measured.float32
    assert m is not None and set(m.tiles_s) == set(m.onednn_s) == set(ROWS)
    mix = {side: calibrate.DECODE_WEIGHT * s[ROWS[0]] + s[ROWS[1]]
           for side, s in (("tiles", m.tiles_s), ("onednn", m.onednn_s))}  # fmt: skip
    assert m.choice == float_calibrate.choose(isa, mix["tiles"], mix["onednn"])
    assert packing.float_product_choice() is None  # measuring leaves the default serving
    path = tmp_path / calibrate.FILE_NAME
    calibrate.write(measured, path)
    sections = {calibrate.KV_CACHE, calibrate.FLOAT32}  # no bfloat16 product for float32
    assert set(json.loads(path.read_text())) == {measured.key, *sections}
    again = calibrate.read(path, measured.key)
    assert again is not None and again.float32 == m
    bf16 = calibrate.measure(isa, "bfloat16", shapes=[(64, 128)], formats=(), kv_step=(4, 40, 32))
    assert bf16.float32 is None  # bfloat16 weights have no float32 product to choose
    alone = float_calibrate.only_tiles()  # where oneDNN cannot prepack float32
    assert "oneDNN cannot prepack" in float_calibrate.describe(alone)
    calibrate.write(replace(measured, float32=alone), path)
    again = calibrate.read(path, measured.key)
    assert again is not None and again.float32 == alone


@pytest.mark.parametrize("choice", [float_calibrate.TILES, float_calibrate.ONEDNN])
def test_a_shard_serves_float32_on_the_product_its_table_chose(
    choice: str, model_dirs, engine_for, tmp_path: Path
) -> None:
    """The packed weights are the chosen product's, /info says it was measured, and the
    logits are the other product's within float32 rounding."""
    isa = isa_with_tiles()
    model_dir = model_dirs("llama_gqa")
    seconds = {rows: 1.0 for rows in ROWS}
    table = calibrate.KernelTable(
        calibrate.machine_key(isa, "float32"),
        float32=FloatMeasured(choice, seconds, seconds, "now"),
    )
    path = tmp_path / calibrate.FILE_NAME
    calibrate.write(table, path)
    chosen = engine_for(model_dir, kernel_table=str(path))
    other = float_calibrate.ONEDNN if choice == float_calibrate.TILES else float_calibrate.TILES
    table.float32 = FloatMeasured(other, seconds, seconds, "now")
    calibrate.write(table, path)
    contrast = engine_for(model_dir, kernel_table=str(path))
    packed = chosen.model.model.layers[0].self_attn.qkv_proj.packed_weight
    assert packed is not None and packing.is_tile_packing(packed) == (choice == "tiles")
    assert "measured here: " in chosen.kernels["products"]
    assert ("float32 tiles" in chosen.kernels["products"]) == (choice == "tiles")
    got = prefill_then_decode_logits(chosen, TOKENS, 4)
    want = prefill_then_decode_logits(contrast, TOKENS, 4)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    plain = engine_for(model_dir)  # no table: the instruction set's default again
    packed = plain.model.model.layers[0].self_attn.qkv_proj.packed_weight
    default = packing.default_float_product(isa)
    assert packed is not None and packing.is_tile_packing(packed) == (default == "tiles")


def test_a_float32_launch_measures_the_float32_product_alone_and_keeps_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model_dirs
) -> None:
    """float32 weights on kernels with the tiles get the table without quantized weights
    (bfloat16 ones need none below the avx512_bf16 kernels): the first launch measures the
    float32 product alone (`cadence calibrate --float-only`), later ones read it; a
    quantized launch on that key measures the rest, and a float32-only measurement keeps
    what was there."""
    isa = isa_with_tiles()
    monkeypatch.setenv("CADENCE_CACHE_DIR", str(tmp_path))
    float_dir = str(model_dirs("llama_gqa"))
    cfg = LaunchConfig(cpu_isa=isa, dtype="float32")
    if isa == "avx512":  # bfloat16 products: oneDNN's alone (no AMX-BF16 tiles)
        assert with_kernel_table(replace(cfg, dtype="bfloat16"), float_dir).kernel_table == ""
    path = tmp_path / calibrate.FILE_NAME
    assert with_kernel_table(cfg, float_dir).kernel_table == str(path)
    key = calibrate.machine_key(isa, "float32")
    alone = calibrate.read(path, key)
    assert alone is not None and alone.float32 is not None
    assert not alone.formats and alone.kv_cache is None  # the float32 product only
    stamp = path.stat().st_mtime_ns
    assert with_kernel_table(cfg, float_dir).kernel_table == str(path)
    assert path.stat().st_mtime_ns == stamp  # read, not measured again
    assert not needs_measuring(alone, float32=True, quantized=False)
    assert needs_measuring(alone, float32=True, quantized=True)  # no formats, no KV cache
    assert needs_measuring(replace(alone, float32=None), float32=True, quantized=False)
    assert needs_measuring(None, float32=False, quantized=True)
    small = {"shapes": [(64, 128)], "formats": ("int8",), "kv_step": (4, 40, 32)}
    full = calibrate.measure(isa, "float32", **small)
    assert not needs_measuring(full, float32=True, quantized=True)
    assert needs_measuring(replace(full, kv_cache=None), float32=False, quantized=True)
    calibrate.write(full, path)
    calibrate.write(replace(full, formats={}, kv_cache=None), path)  # a float32-only run
    kept = calibrate.read(path, key)
    assert kept is not None and kept.formats == full.formats and kept.kv_cache == full.kv_cache


def test_a_launch_keeps_what_the_machine_s_entry_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A quantized launch after a float32 one measures the formats and KV cache only: the
    float32 product chosen first stays chosen (where the two sides nearly tie a second
    measurement may choose the other, and servers started before and after would differ);
    `cadence calibrate --keep-measured`, as a launch runs it, measures nothing it holds."""
    from cadence.cli import main

    isa = isa_with_tiles()
    monkeypatch.setenv("CADENCE_CACHE_DIR", str(tmp_path))
    small = {"shapes": [(64, 128)], "formats": ("int8",), "kv_step": (4, 40, 32)}
    alone = calibrate.measure(isa, "float32", shapes=[(64, 128)], formats=(), kv_step=None)
    # the side not measured faster held as chosen, so that measuring again would show
    sides = {float_calibrate.TILES, float_calibrate.ONEDNN} - {alone.float32.choice}
    held = replace(alone.float32, choice=sides.pop(), measured_at="earlier")
    alone = replace(alone, float32=held)
    rest = calibrate.measure(isa, "float32", **small, kept=alone)
    assert rest.float32 == alone.float32
    assert set(rest.formats) == {"int8"} and rest.kv_cache is not None
    assert calibrate.measure(isa, "float32", **small, kept=rest) == rest  # nothing taken again
    path = tmp_path / calibrate.FILE_NAME
    calibrate.write(alone, path)
    argv = ["calibrate", "--cpu-isa", isa, "--dtype", "float32", "--float32-only"]
    assert main([*argv, "--keep-measured"]) == 0
    assert calibrate.read(path, alone.key).float32 == alone.float32
    assert main(argv) == 0  # on demand: measured again
    assert calibrate.read(path, alone.key).float32.measured_at != "earlier"


def test_launches_at_once_measure_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model_dirs
) -> None:
    """A launch waits for another one's measurement (the table's lock) and then reads it
    instead of measuring again: launches started together serve the same choices."""
    import threading
    import time

    isa = isa_with_tiles()
    monkeypatch.setenv("CADENCE_CACHE_DIR", str(tmp_path))
    cfg = LaunchConfig(cpu_isa=isa, dtype="float32")
    path, model_dir = tmp_path / calibrate.FILE_NAME, str(model_dirs("llama_gqa"))
    measured = calibrate.measure(isa, "float32", shapes=[(64, 128)], formats=(), kv_step=None)
    measured = replace(measured, float32=replace(measured.float32, measured_at="the other's"))
    launched: list[str] = []
    with calibrate.locked(path):  # the other launch, measuring
        waiting = threading.Thread(
            target=lambda: launched.append(with_kernel_table(cfg, model_dir).kernel_table)
        )
        waiting.start()
        time.sleep(0.5)  # without the lock it would have found no table and be measuring
        calibrate.write(measured, path)
    waiting.join()
    assert launched == [str(path)]
    assert calibrate.read(path, measured.key).float32.measured_at == "the other's"


def test_a_table_where_no_lock_can_be_made_is_read_without_one(tmp_path: Path) -> None:
    """A cache the launch cannot write (a read-only image with its table baked in; here a
    folder that cannot be made, its name taken by a file, as even root meets it): the
    launch reads the table, locking nothing, instead of failing."""
    taken = tmp_path / "cache"
    taken.write_text("not a folder")
    with calibrate.locked(taken / calibrate.FILE_NAME):
        assert taken.read_text() == "not a folder"
