"""A step whose rows all attend over the cache (decode rows; with batch invariance, the
prompts' tokens too) runs its layers in `decode_layers` calls (cpu_ops.cpp) where every
product is one call of a C++ kernel -- cadence's AMX-BF16 tiles, the integer product, the
float32 tiles -- and gives the per-layer Python loop's bits (`cadence.runners.
llama_cpu_flat`): the same logits and cache bytes over prompts and decode steps of
sequences of different lengths, across block boundaries and past a sliding window; where
a product is another kernel's (oneDNN), the loop runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cadence.kernels import cpu
from cadence.kernels.cpu import amx_check
from cadence.layers import packed as packing
from cadence.quant import calibrate, cpu_gemm
from cadence.quant.float_calibrate import AMX_BF16, FloatMeasured
from cadence.runners import llama_cpu_flat
from shard_helpers import MiniRouter

PROMPTS = [[5, 17, 42, 9, 77, 3], [120, 64, 8, 33, 2, 11, 90, 14, 7, 60, 21], [44, 45]]
DECODE_STEPS = 12


def _steps(engine) -> list[dict[int, torch.Tensor]]:
    """The logits of three prompts' step, then of DECODE_STEPS decode steps of all three
    (the next tokens forced)."""
    router = MiniRouter(engine)
    joined = [router.join(i, p) for i, p in enumerate(PROMPTS)]
    got = [router.logits_step(joined=joined, forced={i: 10 + i for i in range(3)})]
    for t in range(DECODE_STEPS):
        cont = [router.cont(i) for i in range(3)]
        forced = {i: (37 * t + 11 * i) % 200 + 3 for i in range(3)}
        got.append(router.logits_step(continuing=cont, forced=forced))
    return got


def _compare(make_engine, monkeypatch) -> list[bool]:
    """Two engines from `make_engine`: the first as it runs, the second with the layer
    loop in Python; their logits and caches must agree bit for bit. Returns, per step of
    the first, whether its layers ran in `decode_layers` calls."""
    calls: list[bool] = []
    original = llama_cpu_flat._decode_layers

    def counted(*args):
        y = original(*args)
        calls.append(y is not None)
        return y

    engines = [make_engine() for _ in "ab"]
    with monkeypatch.context() as m:
        m.setattr(llama_cpu_flat, "_decode_layers", counted)
        stacked = _steps(engines[0])
    with monkeypatch.context() as m:
        m.setattr(llama_cpu_flat, "_layer_stack", lambda model, rows, dtype: None)
        looped = _steps(engines[1])
    for n, (a, b) in enumerate(zip(stacked, looped, strict=True)):
        assert all(torch.equal(a[i], b[i]) for i in range(3)), f"step {n}"
    layers = [[(c.k_cache, c.v_cache) for c in e.model.attention_layers()] for e in engines]
    for (ka, va), (kb, vb) in zip(*layers, strict=True):
        assert torch.equal(ka.view(torch.uint8), kb.view(torch.uint8))
        assert torch.equal(va.view(torch.uint8), vb.view(torch.uint8))
    return calls


@pytest.fixture(scope="module")
def amx_bf16(avx512_bf16) -> None:
    """The AMX-BF16 tiles, once their self-test passed in a process of its own (skipped
    where the CPU has none)."""
    if not torch.ops.cadence.amx_bf16_available():
        pytest.skip("this CPU has no AMX-BF16, or the kernel refused AMX permission")
    ok, why = amx_check.usable(timeout_s=600)
    assert ok, f"this CPU grants AMX-BF16 but the AMX products fail their self-test: {why}"


@pytest.fixture
def amx_bf16_table(amx_bf16, tmp_path: Path):
    """A kernel table putting bfloat16 products on the AMX-BF16 tiles."""
    seconds = {calibrate.DECODE_ROWS: 1.0, calibrate.PREFILL_ROWS: 1.0}
    key = calibrate.machine_key(amx_check.ISA, "bfloat16")
    path = tmp_path / "table.json"
    entry = FloatMeasured(AMX_BF16, seconds, seconds, "now")
    calibrate.write(calibrate.KernelTable(key, bf16=entry), path)
    yield str(path)
    packing.use_bf16_product(None)


@pytest.mark.parametrize(
    ("name", "kv", "row_layers"),
    [
        ("llama_9_heads_3_kv", "int8", 8192),
        ("llama_head_dim_64", "int8", 8192),  # the int8 cache's integer attention
        ("llama_9_heads_3_kv", None, 8192),
        ("mistral_window", None, 8192),
        ("llama_9_heads_3_kv", "int8", 1),  # a call per layer, each after the last
    ],
)
def test_amx_bf16_products(
    name, kv, row_layers, amx_bf16_table, model_dirs, engine_for, monkeypatch
) -> None:
    monkeypatch.setattr(llama_cpu_flat, "ROW_LAYERS_PER_CALL", row_layers)
    model_dir = model_dirs(name)
    calls = _compare(
        lambda: engine_for(
            model_dir, dtype="bfloat16", kernel_table=amx_bf16_table, kv_cache_dtype=kv
        ),
        monkeypatch,
    )
    assert calls == [True] * (1 + DECODE_STEPS), calls  # the prompts' step and every decode


def _integer_table(tmp_path: Path, dtype: str) -> str:
    """A kernel table putting int4 products on the integer product at every row count."""
    seconds = {calibrate.DECODE_ROWS: 1.0, calibrate.PREFILL_ROWS: 10.0}
    key = calibrate.machine_key(cpu.selected_isa() or "scalar", dtype)
    entry = calibrate.Measured(calibrate.INTEGER, seconds, seconds, "now")
    path = tmp_path / "integer.json"
    calibrate.write(calibrate.KernelTable(key, {"int4": entry, "int8": entry}), path)
    return str(path)


@pytest.mark.usefixtures("cpu_isa")
@pytest.mark.parametrize(("dtype", "kv"), [("float32", None), ("bfloat16", "int8")])
def test_the_integer_product(dtype, kv, model_dirs, engine_for, tmp_path: Path, monkeypatch):
    """--quantize int4 on the integer product (where it is this build's kernel: VNNI's or
    AVX2's tiles; elsewhere torch's kernels, and the loop)."""
    model_dir = model_dirs("llama_head_dim_64")  # int4 groups of 32 across its widths
    table = _integer_table(tmp_path, dtype)
    if kv == "int8" and cpu.selected_isa() != "avx512_bf16":
        kv = None  # the int8 cache's integer attention is avx512_bf16's (others convert)
    calls = _compare(
        lambda: engine_for(
            model_dir, dtype=dtype, quantize="int4", kernel_table=table, kv_cache_dtype=kv
        ),
        monkeypatch,
    )
    integer = cpu_gemm.integer_product_is_fast(cpu.selected_isa() or "scalar")
    assert calls == [True] * (1 + DECODE_STEPS) if integer else not calls, calls


@pytest.mark.usefixtures("cpu_isa")
def test_a_step_in_a_call_per_layer(model_dirs, engine_for, tmp_path: Path, monkeypatch):
    """A step of more rows x layers than a call may take runs a layer, times it, and goes
    on in calls sized by that time (here a layer each): the loop's bits, every step's
    layers in decode_layers calls."""
    monkeypatch.setattr(llama_cpu_flat, "ROW_LAYERS_PER_CALL", 1)
    if not cpu_gemm.integer_product_is_fast(cpu.selected_isa() or "scalar"):
        pytest.skip("the integer product is not this build's kernel: the loop serves")
    table = _integer_table(tmp_path, "float32")
    model_dir = model_dirs("llama_head_dim_64")
    calls = _compare(
        lambda: engine_for(model_dir, dtype="float32", quantize="int4", kernel_table=table),
        monkeypatch,
    )
    assert calls == [True] * (1 + DECODE_STEPS), calls


def test_a_call_takes_about_beat_seconds_at_the_rate_measured() -> None:
    layers, beat = llama_cpu_flat.layers_per_call, llama_cpu_flat.BEAT_SECONDS
    assert layers(30, 30, 0, 0.0) == 30  # the rows allow every layer: one call
    assert layers(6, 30, 0, 0.0) == 1  # a step of several calls: one layer first, timed
    assert layers(6, 30, 1, 3 * beat) == 1  # a layer took three beats: one a call
    assert layers(6, 30, 2, beat / 2) == 4  # a layer took a quarter of one: four a call
    assert layers(6, 30, 3, beat / 100) == 6  # fast layers: the rows' bound still holds


@pytest.mark.usefixtures("cpu_isa")
def test_the_float32_tiles(model_dirs, engine_for, monkeypatch):
    """A float32 model on cadence's float32 tiles (where they serve: the avx2 kernels by
    default; elsewhere oneDNN, and the loop)."""
    model_dir = model_dirs("mistral_window")
    calls = _compare(lambda: engine_for(model_dir, dtype="float32"), monkeypatch)
    assert calls == [True] * (1 + DECODE_STEPS) if packing.float_tiles_serve() else not calls


def test_decode_layers_checks_its_lists() -> None:
    """A layer count the lists disagree on is a clear error naming the operator."""
    if not cpu.available():
        pytest.skip(f"no CPU kernels: {cpu.unavailable_reason()}")
    op = torch.ops.cadence.decode_layers
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    idx = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="decode_layers.*10 weights, 16 specs"):
        op(x, None, [x] * 9, [0] * 16, [x, x], [], [0], x, x, idx, idx.view(2, 1), idx, 1, 1,
           1.0, 1e-5)  # fmt: skip
