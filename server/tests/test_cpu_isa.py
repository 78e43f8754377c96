"""Choosing the CPU kernels' instruction set from the CPU's flags, and the dtype that
goes with it: what `cadence launch` decides at start (`--cpu-isa`, `--dtype auto`)."""

from __future__ import annotations

import pytest
from cadence import cpu_isa as isa
from cadence.config import ShardConfig
from cadence.launcher import LaunchConfig, LaunchError, resolve_cpu_choices

SAPPHIRE_RAPIDS = frozenset(
    "sse2 avx avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512cd avx512_bf16 "
    "avx512_vnni".split()
)
SKYLAKE_X = frozenset("sse2 avx avx2 fma f16c avx512f avx512bw avx512vl avx512dq".split())
EPYC_ZEN2 = frozenset("sse2 avx avx2 fma f16c bmi2".split())
OLD_ATOM = frozenset("sse2 ssse3".split())


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (SAPPHIRE_RAPIDS, ("avx512_bf16", "avx512", "avx2", "scalar")),
        (SKYLAKE_X, ("avx512", "avx2", "scalar")),
        (EPYC_ZEN2, ("avx2", "scalar")),
        (OLD_ATOM, ("scalar",)),
    ],
)
def test_supported_instruction_sets_follow_the_cpu_flags(flags, expected, monkeypatch):
    monkeypatch.setattr(isa, "is_x86", lambda: True)
    monkeypatch.delenv("CADENCE_CPU_ISA", raising=False)
    assert isa.supported(flags) == expected
    assert isa.resolve("auto", flags) == expected[0]
    assert isa.resolve(None, flags) == expected[0]  # $CADENCE_CPU_ISA unset


def test_a_forced_instruction_set_the_cpu_lacks_names_what_is_missing(monkeypatch):
    monkeypatch.setattr(isa, "is_x86", lambda: True)
    with pytest.raises(
        isa.IsaError, match="lacks avx512_bf16, avx512_vnni, avx512bw.*runs: avx2, scalar"
    ):
        isa.resolve("avx512_bf16", EPYC_ZEN2)
    with pytest.raises(isa.IsaError, match="not one of"):
        isa.resolve("sse9", EPYC_ZEN2)
    assert isa.resolve("avx2", SAPPHIRE_RAPIDS) == "avx2"  # a lesser one is always allowed
    assert isa.resolve("scalar", OLD_ATOM) == "scalar"


def test_the_environment_twin_is_read_when_no_flag_is_given(monkeypatch):
    monkeypatch.setattr(isa, "is_x86", lambda: True)
    monkeypatch.setenv("CADENCE_CPU_ISA", "avx2")
    assert isa.resolve(None, SAPPHIRE_RAPIDS) == "avx2"


def test_only_the_scalar_build_exists_off_x86(monkeypatch):
    monkeypatch.setattr(isa, "is_x86", lambda: False)
    assert isa.buildable() == ("scalar",)
    assert isa.supported(SAPPHIRE_RAPIDS) == ("scalar",)
    assert isa.compile_flags("scalar") == ()
    with pytest.raises(isa.IsaError, match="an avx2 build"):
        isa.resolve("avx2", SAPPHIRE_RAPIDS)


@pytest.mark.parametrize(
    ("flags", "device", "dtype"),
    [
        (SAPPHIRE_RAPIDS, "cpu", "bfloat16"),
        (SKYLAKE_X, "cpu", "float32"),
        (EPYC_ZEN2, "cpu", "float32"),
        (EPYC_ZEN2, "cuda", "bfloat16"),
    ],
)
def test_dtype_auto_is_bfloat16_only_where_it_is_the_faster(flags, device, dtype, monkeypatch):
    monkeypatch.setattr(isa, "is_x86", lambda: True)
    monkeypatch.setattr(isa, "cpu_flags", lambda: flags)
    monkeypatch.delenv("CADENCE_CPU_ISA", raising=False)
    cfg = resolve_cpu_choices(LaunchConfig(device=device))
    assert cfg.dtype == dtype
    assert cfg.cpu_isa == isa.supported(flags)[0]
    # an explicit dtype is kept; the shard's config resolves the same way
    assert resolve_cpu_choices(LaunchConfig(device=device, dtype="float16")).dtype == "float16"
    shard = resolve_cpu_choices(ShardConfig("m", "s", dtype="auto", device=device))
    assert (shard.dtype, shard.cpu_isa) == (dtype, cfg.cpu_isa)


@pytest.mark.parametrize(
    ("device", "dtype", "kv_asked", "kv"),
    [
        ("cpu", "float32", None, "bfloat16"),  # a 16-bit cache under 32-bit arithmetic
        ("cpu", "bfloat16", None, "bfloat16"),
        ("cpu", "float16", None, "float16"),
        ("cpu", "float32", "float32", "float32"),  # asked for: kept
        ("cuda", "float32", None, "float32"),
    ],
)
def test_the_kv_cache_is_bfloat16_by_default_on_cpu(device, dtype, kv_asked, kv):
    cfg = resolve_cpu_choices(LaunchConfig(device=device, dtype=dtype, kv_cache_dtype=kv_asked))
    assert cfg.kv_cache_dtype == kv


def test_launch_refuses_an_instruction_set_the_cpu_lacks_before_starting_anything(monkeypatch):
    monkeypatch.setattr(isa, "is_x86", lambda: True)
    monkeypatch.setattr(isa, "cpu_flags", lambda: EPYC_ZEN2)
    with pytest.raises(LaunchError, match="--cpu-isa avx512: this CPU lacks avx512bw"):
        resolve_cpu_choices(LaunchConfig(cpu_isa="avx512"))


def test_this_machine_runs_at_least_the_portable_kernels():
    assert isa.supported()[-1] == "scalar"
    assert isa.resolve("scalar") == "scalar"


@pytest.mark.parametrize(
    ("vendor", "family", "model", "generation"),
    [
        ("AuthenticAMD", 25, 17, "Zen 4"),  # EPYC 9004 (Genoa), often named just "AMD EPYC"
        ("AuthenticAMD", 25, 1, "Zen 3"),  # EPYC 7003 (Milan)
        ("AuthenticAMD", 26, 2, "Zen 5"),  # EPYC 9005 (Turin)
        ("AuthenticAMD", 23, 49, "Zen 2"),  # EPYC 7002 (Rome)
        ("GenuineIntel", 6, 143, "Sapphire Rapids"),
        ("GenuineIntel", 6, 106, "Ice Lake-SP"),
        ("GenuineIntel", 6, 1, None),  # unknown: the name and numbers alone
    ],
)
def test_the_cpu_generation_is_told_by_family_and_model(vendor, family, model, generation):
    """CPUs with the same ISA names differ: figures name the generation, not only the ISA."""
    assert isa.generation(vendor, family, model) == generation


def test_the_cpu_model_names_family_and_model_on_x86():
    if not isa.is_x86():
        pytest.skip("family and model numbers are x86's")
    assert " (family " in isa.cpu_model() and " model " in isa.cpu_model()
