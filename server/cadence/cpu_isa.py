"""Which instruction set the CPU kernels run with: read once from what the CPU reports.

The C++ kernels are compiled once per instruction set (`ISAS`, best first), each with
explicit `-march` flags rather than the build host's `-march=native`, so what runs is
decided by the CPU the shard starts on, not by the one that compiled it:

- `avx512_bf16`: AVX-512 (F, BW, VL, DQ) with the BF16 dot products (vdpbf16ps) and VNNI's
  int8 ones (vpdpbusd; every CPU with the first has the second): the hand-written
  bfloat16 paths (decode attention, norms, SwiGLU, rotary, greedy) and the integer
  product of quantized weights;
- `avx512`: AVX-512 without BF16 (Skylake-X, Ice Lake, Zen 4 without the flag);
- `avx2`: AVX2 + FMA + F16C (x86-64-v3: Haswell and later, every Zen), with the integer
  product of quantized weights on vpmaddubsw;
- `scalar`: baseline x86-64 (SSE2), and what an aarch64 build compiles to.

Below `avx512_bf16` the kernels are the same C++ auto-vectorized for the wider or
narrower registers.

Free of torch, so that the launcher (which resolves the choice before any shard starts)
and the command line start without importing it.
"""

from __future__ import annotations

import os
import platform
from functools import cache

ISAS = ("avx512_bf16", "avx512", "avx2", "scalar")

# The /proc/cpuinfo flags each instruction set needs.
REQUIRED_FLAGS: dict[str, frozenset[str]] = {
    "avx512_bf16": frozenset(
        {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"}
    ),
    "avx512": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"}),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "scalar": frozenset(),
}

# Compiler flags per instruction set on x86-64 (psABI levels; v4 = AVX-512 F/BW/CD/DQ/VL).
X86_FLAGS: dict[str, tuple[str, ...]] = {
    "avx512_bf16": ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"),
    "avx512": ("-march=x86-64-v4",),
    "avx2": ("-march=x86-64-v3",),
    "scalar": ("-march=x86-64",),
}

ENV = "CADENCE_CPU_ISA"


class IsaError(ValueError):
    """A requested instruction set this CPU (or this architecture) does not have."""


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def buildable() -> tuple[str, ...]:
    """The instruction sets a library is compiled for on this architecture."""
    return ISAS if is_x86() else ("scalar",)


def compile_flags(isa: str) -> tuple[str, ...]:
    return X86_FLAGS[isa] if is_x86() else ()


def _cpuinfo(*keys: str) -> str | None:
    """The first processor's value of the first of `keys` in /proc/cpuinfo (x86 and ARM
    name the same things differently), or None where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in keys:
                    return value.strip()
    except OSError:
        pass
    return None


@cache
def cpu_flags() -> frozenset[str]:
    """The processor's feature flags (empty where /proc/cpuinfo has none)."""
    return frozenset((_cpuinfo("flags", "Features") or "").split())


# (vendor, family, first model, last model) -> core generation, for the x86 server parts
# cadence is measured on. A virtual machine's "model name" is often only "AMD EPYC" or
# "Intel Xeon Processor": the family and model numbers tell Zen 4 from Zen 5 and Sapphire
# Rapids from Ice Lake, which have the same ISA names and differ in speed.
GENERATIONS: tuple[tuple[str, int, int, int, str], ...] = (
    ("AuthenticAMD", 0x17, 0x00, 0x2F, "Zen/Zen+"),
    ("AuthenticAMD", 0x17, 0x30, 0xFF, "Zen 2"),
    ("AuthenticAMD", 0x19, 0x00, 0x0F, "Zen 3"),
    ("AuthenticAMD", 0x19, 0x10, 0x1F, "Zen 4"),
    ("AuthenticAMD", 0x19, 0x20, 0x5F, "Zen 3"),
    ("AuthenticAMD", 0x19, 0x60, 0xAF, "Zen 4"),
    ("AuthenticAMD", 0x1A, 0x00, 0xFF, "Zen 5"),
    ("GenuineIntel", 6, 0x55, 0x55, "Skylake-SP/Cascade Lake"),
    ("GenuineIntel", 6, 0x6A, 0x6C, "Ice Lake-SP"),
    ("GenuineIntel", 6, 0x8F, 0x8F, "Sapphire Rapids"),
    ("GenuineIntel", 6, 0xCF, 0xCF, "Emerald Rapids"),
    ("GenuineIntel", 6, 0xAD, 0xAE, "Granite Rapids"),
)


def generation(vendor: str, family: int, model: int) -> str | None:
    """The core generation of an x86 CPU by its family and model numbers, where known."""
    for v, f, first, last, name in GENERATIONS:
        if v == vendor and f == family and first <= model <= last:
            return name
    return None


@cache
def cpu_model() -> str:
    """The processor's name as /proc/cpuinfo gives it, with its family and model numbers
    (and generation where known) on x86: "AMD EPYC (family 25 model 17: Zen 4)"."""
    name = _cpuinfo("model name", "Model", "cpu model") or platform.processor()
    family, model = _cpuinfo("cpu family"), _cpuinfo("model")
    if not (family and model and family.isdigit() and model.isdigit()):
        return name
    known = generation(_cpuinfo("vendor_id") or "", int(family), int(model))
    return f"{name} (family {family} model {model}{f': {known}' if known else ''})"


def supported(flags: frozenset[str] | None = None) -> tuple[str, ...]:
    """The instruction sets this CPU runs, best first."""
    flags = cpu_flags() if flags is None else flags
    return tuple(isa for isa in buildable() if REQUIRED_FLAGS[isa] <= flags)


def missing(isa: str, flags: frozenset[str] | None = None) -> list[str]:
    """The CPU flags `isa` needs that this CPU lacks (empty when it runs it)."""
    flags = cpu_flags() if flags is None else flags
    if isa not in buildable():
        return [f"an {isa} build (this is {platform.machine()})"]
    return sorted(REQUIRED_FLAGS[isa] - flags)


def resolve(requested: str | None = None, flags: frozenset[str] | None = None) -> str:
    """The instruction set to run: `requested` ("auto", an entry of ISAS, or None for
    $CADENCE_CPU_ISA, else auto) after checking the CPU has it."""
    requested = (requested or os.environ.get(ENV) or "auto").strip().lower()
    if requested == "auto":
        return supported(flags)[0]
    if requested not in ISAS:
        raise IsaError(f"--cpu-isa {requested!r} is not one of auto, {', '.join(ISAS)}")
    lacking = missing(requested, flags)
    if lacking:
        raise IsaError(
            f"--cpu-isa {requested}: this CPU lacks {', '.join(lacking)} "
            f"(it runs: {', '.join(supported(flags))})"
        )
    return requested


def bfloat16_is_fast(isa: str) -> bool:
    """Whether bfloat16 weights and activations beat float32 with this instruction set:
    only with native BF16 dot products (oneDNN's bf16 products and the bf16 attention
    kernel); elsewhere oneDNN refuses to prepack bf16 or emulates it, and torch's bf16
    products ran at a quarter of prepacked float32's speed (SmolLM2's at 32 rows with
    torch and oneDNN held to AVX2: 175.6 against 45.1 ms, docs/benchmarks.md)."""
    return isa == "avx512_bf16"


def default_dtype(device: str, isa: str) -> str:
    """The dtype `--dtype auto` serves in."""
    if not device.startswith("cpu"):
        return "bfloat16"
    return "bfloat16" if bfloat16_is_fast(isa) else "float32"


def default_kv_cache_dtype(device: str, dtype: str) -> str:
    """The KV cache's dtype when none is asked for: bfloat16 under float32 weights on a
    CPU, as llama.cpp keeps a 16-bit cache under 32-bit arithmetic (half the memory, and
    decode attention reads half the bytes: 24 -> 14 ms a step at batch 32 x 350 on the
    AVX2 kernels), so the cache is bfloat16 by default on every CPU; else the weights'."""
    if device.startswith("cpu") and dtype == "float32":
        return "bfloat16"
    return dtype
