"""The kernel table (docs/quantization.md, "Kernels and dispatch"): which kernel multiplies
quantized weights, measured on the machine, cached per CPU, handed to the shards; a
format measured faster through its float copy is served by it at every row count."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from cadence import cpu_isa
from cadence.config import LaunchConfig
from cadence.kernels import cpu as cpu_kernels
from cadence.launcher import needs_measuring, with_kernel_table, with_measured_kv_cache
from cadence.quant import calibrate, float_calibrate, kv_calibrate
from cadence.quant.crossover import ALL_ROWS
from shard_helpers import prefill_then_decode_logits

TOKENS = [5, 17, 9, 33, 2, 48, 11, 7, 21, 30, 4, 8]


def table(kernel: str, isa: str, dtype: str, kv: str = "bfloat16") -> calibrate.KernelTable:
    seconds = {calibrate.DECODE_ROWS: 1.0, calibrate.PREFILL_ROWS: 10.0}
    key = calibrate.machine_key(isa, dtype)
    entry = calibrate.Measured(kernel, seconds, seconds, "now")
    halved = {"bfloat16": 1.0, "int8": 0.5}
    kv_cache = kv_calibrate.KvMeasured(kv, halved, "now", prompt_seconds=halved)
    return calibrate.KernelTable(key, {"int4": entry, "int8": entry}, kv_cache)


def test_the_float_copy_must_win_by_the_margin() -> None:
    integer = {calibrate.DECODE_ROWS: 1.0, calibrate.PREFILL_ROWS: 10.0}
    close = {rows: s * 0.97 for rows, s in integer.items()}
    faster = {rows: s * 0.9 for rows, s in integer.items()}
    assert calibrate.choose(integer, close) == calibrate.INTEGER
    assert calibrate.choose(integer, faster) == calibrate.FLOAT
    assert calibrate.choose(faster, integer) == calibrate.INTEGER


def test_an_int8_kv_cache_must_win_by_the_margin() -> None:
    def choose(decode_int8: float, prompt_int8: float) -> str:
        float_s = {"bfloat16": 1.0}
        return kv_calibrate.choose(float_s | {"int8": decode_int8}, float_s | {"int8": prompt_int8},
                                   "bfloat16")  # fmt: skip

    assert choose(0.97, 0.97) == "bfloat16"
    assert choose(0.9, 0.9) == "int8"
    assert choose(1.2, 1.2) == "bfloat16"
    # a Zen 3's AVX2 kernels: int8 wins the decode step and loses the prompts by more than
    # the decode steps make up in the charter's mix (4.5 decode steps a prompt)
    assert choose(28.3 / 30.5, 90.2 / 56.7) == "bfloat16"
    assert choose(0.8, 1.2) == "int8"  # 4.5 x 0.2 saved, 0.2 lost


def test_a_kv_choice_made_on_the_decode_step_alone_is_measured_again() -> None:
    """A table from before prompts were timed: a launch measures its KV cache again (and
    keeps its products), so the choice a decode step alone made does not serve on."""
    old = table("integer", "avx2", "float32", kv="int8")
    assert old.kv_cache is not None
    old.kv_cache.prompt_seconds = {}
    assert needs_measuring(old, float32=False, quantized=True)
    assert not needs_measuring(table("integer", "avx2", "float32"), float32=False, quantized=True)
    isa = cpu_kernels.select("auto") or "scalar"
    kept = table("integer", isa, "float32", kv="int8")
    assert kept.kv_cache is not None
    kept.kv_cache.prompt_seconds = {}
    again = calibrate.measure(isa, "float32", shapes=[(64, 128)], formats=("int4", "int8"),
                              kv_step=(4, 40, 32), kept=kept)  # fmt: skip
    assert again.formats == kept.formats
    assert again.kv_cache is not None and set(again.kv_cache.prompt_seconds) == {"bfloat16", "int8"}
    assert again.kv_cache.prompt_len == 32


def test_a_measurement_is_written_per_machine_and_read_back(tmp_path: Path) -> None:
    isa = cpu_kernels.select("auto") or "scalar"
    measured = calibrate.measure(isa, "float32", shapes=[(64, 128), (128, 64)], kv_step=(4, 40, 32))
    assert measured.key == calibrate.machine_key(isa, "float32")
    kv = measured.kv_cache  # a float32 serve's cache is bfloat16: int8 is timed against it
    assert kv is not None and set(kv.seconds) == {"bfloat16", "int8"}
    assert set(kv.prompt_seconds) == {"bfloat16", "int8"}
    assert kv.choice == kv_calibrate.choose(kv.seconds, kv.prompt_seconds, "bfloat16")
    assert (kv.rows, kv.context, kv.prompt_len) == (4, 40, 32)
    assert cpu_isa.cpu_model() in measured.key
    for m in measured.formats.values():
        assert m.tiles == calibrate.choose_tiles(m.integer_s, m.amx_s)
        served = m.amx_s if m.tiles == calibrate.AMX else m.integer_s
        assert m.kernel == calibrate.choose(served, m.float_s)
        assert m.amx_s or "AMX tiles not timed" in m.amx_note, m.amx_note
        assert set(m.integer_s) == set(m.float_s) == {calibrate.DECODE_ROWS, calibrate.PREFILL_ROWS}
    path = tmp_path / "kernel_table.json"
    other = replace(table(calibrate.FLOAT, isa, "bfloat16"), key="another machine")
    calibrate.write(other, path)
    calibrate.write(measured, path)
    written = json.loads(path.read_text())
    float_section = {calibrate.FLOAT32} if measured.float32 else set()  # test_float_calibrate
    assert set(written) == {"another machine", measured.key, calibrate.KV_CACHE, *float_section}
    assert set(written[calibrate.KV_CACHE]) == {"another machine", measured.key}
    again = calibrate.read(path, measured.key)
    assert again is not None and again.formats == measured.formats
    assert again.kv_cache == measured.kv_cache
    assert calibrate.read(path, "a third machine") is None
    # a table handed over from one machine serves on another; the KV section is no machine
    one = tmp_path / "one.json"
    calibrate.write(other, one)
    handed = calibrate.read_for_machine(one, measured.key)
    assert handed is not None and handed.kv_cache == other.kv_cache


def test_amx_tiles_serve_where_faster_without_a_margin_and_old_tables_read_as_vector(
    tmp_path: Path,
) -> None:
    vector = {calibrate.DECODE_ROWS: 1.0, calibrate.PREFILL_ROWS: 10.0}
    slightly = {rows: s * 0.99 for rows, s in vector.items()}
    assert calibrate.choose_tiles(vector, {}) == calibrate.VECTOR
    assert calibrate.choose_tiles(vector, slightly) == calibrate.AMX  # same bits: no margin
    assert calibrate.choose_tiles(slightly, vector) == calibrate.VECTOR
    entry = calibrate.Measured(
        calibrate.INTEGER, vector, vector, "now", calibrate.AMX, slightly, "equal bit for bit"
    )
    path = tmp_path / "table.json"
    calibrate.write(calibrate.KernelTable("machine", {"int4": entry}), path)
    again = calibrate.read(path, "machine")
    assert again is not None and again.formats["int4"] == entry
    assert "integer on AMX tiles (" in calibrate.describe(again, "int4")
    assert "AMX tiles 0.99 / 9.9" not in calibrate.describe(again, "int4")  # ms, not s
    data = json.loads(path.read_text())  # a table written before the tiles were measured
    for field in ("tiles", "amx_s", "amx_note"):
        del data["machine"]["int4"][field]
    path.write_text(json.dumps(data))
    old = calibrate.read(path, "machine")
    assert old is not None and old.formats["int4"].tiles == calibrate.VECTOR


def test_a_table_choosing_amx_tiles_serves_on_them_only_where_this_process_may(
    tmp_path: Path,
) -> None:
    """AMX where the CPU has it and the kernel grants it; the vector tiles (the same bits)
    everywhere else, a handed-over table's choice included."""
    from cadence.quant import cpu_gemm, setup

    seconds = {calibrate.DECODE_ROWS: 1.0, calibrate.PREFILL_ROWS: 10.0}
    amx = calibrate.Measured(calibrate.INTEGER, seconds, seconds, "now", calibrate.AMX, seconds)
    floats = calibrate.Measured(calibrate.FLOAT, seconds, seconds, "now", calibrate.AMX, seconds)
    try:
        setup.use_measured_tiles(calibrate.KernelTable("m", {"int4": amx, "int8": floats}))
        want = cpu_gemm.AMX_TILES if setup.amx_available() else cpu_gemm.VECTOR_TILES
        assert cpu_gemm.tiles_of("int4") == want
        assert cpu_gemm.tiles_of("int8") == cpu_gemm.VECTOR_TILES  # the float copy serves
    finally:
        cpu_gemm.use_tiles("int4", cpu_gemm.VECTOR_TILES)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_float_choice_serves_the_checkpoints_own_float_weights(
    dtype: str, model_dirs, engine_for, tmp_path: Path
) -> None:
    """--quantize int4 with the table choosing the float copy: the float product at every
    row count, so the logits are the unquantized model's bit for bit, batch invariance
    holding; with the integer choice the int4 kernel serves every row count."""
    model_dir = model_dirs("llama_gqa")
    plain = engine_for(model_dir, dtype=dtype)
    isa = cpu_kernels.selected_isa() or "scalar"
    path = tmp_path / "floats.json"
    calibrate.write(table(calibrate.FLOAT, isa, dtype), path)
    floats = engine_for(model_dir, dtype=dtype, quantize="int4", kernel_table=str(path))
    qkv = floats.model.model.layers[0].self_attn.qkv_proj
    assert qkv.quantized is not None and not qkv.quantized.serves(1)
    assert floats.quantization["crossover"]["int4"]["rows"] == 0
    assert floats.quantization["crossover"]["int4"]["from"].startswith("float (")
    assert floats.determinism.on, floats.determinism.detail
    assert "at every row count (measured faster here" in floats.kernels["products"]
    expected = prefill_then_decode_logits(plain, TOKENS, 8)
    assert torch.equal(prefill_then_decode_logits(floats, TOKENS, 8), expected)

    calibrate.write(table(calibrate.INTEGER, isa, dtype), path)
    integer = engine_for(model_dir, dtype=dtype, quantize="int4", kernel_table=str(path))
    assert integer.quantization["crossover"]["int4"]["rows"] == ALL_ROWS
    assert integer.model.model.layers[0].self_attn.qkv_proj.quantized.serves(4096)


def test_launch_measures_once_per_machine_and_hands_the_table_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model_dirs
) -> None:
    """A quantized model on CPU: the first launch measures (`cadence calibrate`, its own
    process), later ones read the cache; a GPU needs none, nor a bfloat16 model below the
    avx512_bf16 kernels (on them its product is measured: AMX-BF16 tiles or oneDNN)."""
    monkeypatch.setenv("CADENCE_CACHE_DIR", str(tmp_path))
    isa = cpu_isa.resolve("auto")
    # float32 where the float32 product is measured too, so that one measurement covers both
    dtype = "float32" if float_calibrate.can_measure(isa) else cpu_isa.default_dtype("cpu", isa)
    cfg = LaunchConfig(cpu_isa=isa, dtype=dtype, quantize="int4")
    float_dir = str(model_dirs("llama_gqa"))
    bf16 = replace(cfg, quantize=None, dtype="bfloat16", cpu_isa="avx512")
    assert with_kernel_table(bf16, float_dir).kernel_table == ""
    assert with_kernel_table(replace(cfg, device="cuda"), float_dir).kernel_table == ""
    measured = with_kernel_table(cfg, float_dir)
    assert measured.kernel_table == str(tmp_path / calibrate.FILE_NAME)
    written = calibrate.read(Path(measured.kernel_table), calibrate.machine_key(isa, cfg.dtype))
    assert written is not None and set(written.formats) == set(calibrate.FORMATS)
    assert written.kv_cache is not None and written.kv_cache.choice in written.kv_cache.seconds
    assert (written.float32 is not None) == (dtype == "float32")
    stamp = Path(measured.kernel_table).stat().st_mtime_ns
    assert with_kernel_table(cfg, float_dir).kernel_table == measured.kernel_table
    assert Path(measured.kernel_table).stat().st_mtime_ns == stamp  # read, not measured again
    if isa == "avx512_bf16":
        float_bf16 = with_kernel_table(replace(bf16, cpu_isa=isa), float_dir)
        key = calibrate.machine_key(isa, "bfloat16")
        entry = calibrate.read(Path(float_bf16.kernel_table), key)
        assert entry is not None and entry.bf16 is not None, entry
        assert entry.bf16.choice in (float_calibrate.AMX_BF16, float_calibrate.ONEDNN)
        timed = bool(entry.bf16.tiles_s)  # where the AMX-BF16 tiles can serve
        assert timed == ("amx_bf16" in cpu_isa.cpu_flags())


@pytest.mark.parametrize("measured", ["int8", "bfloat16"])
def test_quantized_serving_takes_the_kv_cache_measured_fastest(
    measured: str, tmp_path: Path
) -> None:
    """The table's KV cache choice is the default for quantized serving (`with_kernel_table`
    hands no table to a float model); a cache asked for, or an fp8 scales file, wins."""
    isa = cpu_isa.resolve("auto")
    dtype = cpu_isa.default_dtype("cpu", isa)
    path = tmp_path / calibrate.FILE_NAME
    calibrate.write(table(calibrate.INTEGER, isa, dtype, kv=measured), path)
    cfg = LaunchConfig(cpu_isa=isa, dtype=dtype, kv_cache_dtype="bfloat16", kernel_table=str(path))
    assert with_measured_kv_cache(cfg, kv_asked=False).kv_cache_dtype == measured
    assert with_measured_kv_cache(cfg, kv_asked=True).kv_cache_dtype == "bfloat16"
    fp8 = replace(cfg, kv_cache_scales=str(tmp_path / "scales.json"))
    assert with_measured_kv_cache(fp8, kv_asked=False).kv_cache_dtype == "bfloat16"
    assert with_measured_kv_cache(replace(cfg, kernel_table=""), False).kv_cache_dtype == "bfloat16"
    float_weights = with_measured_kv_cache(cfg, kv_asked=False, quantized=False)
    assert float_weights.kv_cache_dtype == "bfloat16"  # a float32 model's table: no KV choice


def test_the_launcher_keys_the_table_without_importing_torch() -> None:
    """`cadence launch` looks its machine's entry up before any shard starts: importing
    torch for it cost every launch 1.5 s."""
    import subprocess
    import sys

    code = (
        "import sys; from cadence.quant import calibrate; "
        "calibrate.machine_key('avx512_bf16', 'bfloat16'); print('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_a_table_without_this_machines_entry_is_said_once_and_the_defaults_serve(
    tmp_path: Path,
) -> None:
    """A table file holding other machines', dtypes' or kernel builds' entries but not this
    one's: the defaults serve, and the shard says why once (an edit of the kernels changes
    the key, so a table measured before it no longer applies)."""
    from cadence.quant import setup
    from loguru import logger

    seconds = {calibrate.DECODE_ROWS: 1.0, calibrate.PREFILL_ROWS: 10.0}
    measured = calibrate.Measured(calibrate.FLOAT, seconds, seconds, "now")
    path = tmp_path / "table.json"
    for key in ("machine-a", "machine-b"):
        calibrate.write(calibrate.KernelTable(key, {"int4": measured}), path)
    said: list[str] = []
    sink = logger.add(lambda m: said.append(m.record["message"]), level="WARNING")
    try:
        assert setup.read_table(str(path), "machine-c") is None
        assert setup.read_table(str(path), "machine-c") is None
        found = setup.read_table(str(path), "machine-a")
    finally:
        logger.remove(sink)
    assert found is not None and found.formats["int4"].kernel == calibrate.FLOAT
    assert len(said) == 1 and "machine-c" in said[0] and str(path) in said[0]
