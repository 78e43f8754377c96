"""The integer product of quantized weights (`cadence.quant.cpu_gemm`, int8 activations)
against torch's weight-only kernels (`cadence.quant.cpu_kernels`) and the float product a
shard serves (oneDNN, weight prepacked), over a whole SmolLM2-135M step's products (30
layers + LM head, every weight distinct), per row count; then, per quantized kernel, the
rows up to which it beats the float product (`measure.crossover_from`).

The float product is timed beside each quantized one (`measure.time_rows`): its column is
the faster of the two. Hold the libraries to AVX2 with `ONEDNN_MAX_CPU_ISA=AVX2
ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 CADENCE_CPU_ISA=avx2` (and
`--dtype float32`, what is served there).

    python benchmarks/kernels/quant_integer_bench.py [--threads 2] [--dtype float32] [--rows 1,4,8]
        [--formats int4,int8]
"""

from __future__ import annotations

import argparse
import os

import torch
from cadence import cpu_isa as isa
from cadence.kernels import cpu
from cadence.quant import cpu_gemm, measure
from cadence.quant.cpu_kernels import Int4CpuKernel, Int8CpuKernel
from cadence.quant.formats import Int8Weight, QuantizedWeight
from cadence.quant.product import Kernel

ROWS = (1, 4, 8, 16, 32, 64, 128, 320)
REPEATS = 7  # passes per measurement: the fastest call of each product counts
VARIANTS = (("int4", 32), ("int8", 0))  # (format, group size)


def torch_kernel(weight: QuantizedWeight) -> Kernel:
    return Int8CpuKernel(weight) if isinstance(weight, Int8Weight) else Int4CpuKernel(weight)


def step_times(
    fmt: str, group: int, dtype: torch.dtype, rows: list[int], repeats: int
) -> dict[int, tuple[float, float, float]]:
    """(float, torch's, integer) seconds of a whole step's products per row count, over the
    same weights (the same seed for both builds)."""
    built = []
    for kernel in (torch_kernel, cpu_gemm.IntegerCpuKernel):
        torch.manual_seed(0)
        built.append(measure.build(measure.model_shapes(), fmt, group, dtype, kernel))
    times = {}
    for r in rows:
        (float_a, torch_s), (float_b, integer_s) = (
            measure.time_rows(b, r, dtype, repeats) for b in built
        )
        times[r] = (min(float_a, float_b), torch_s, integer_s)
        f, t, i = (s * 1e3 for s in times[r])
        cells = f"{f:9.2f} {t:9.2f} {i:9.2f}  {f / t:5.2f}x {f / i:5.2f}x"
        print(f"  {_name(fmt, group):>8} {r:>4} {cells}", flush=True)
    return times


def crossovers(times: dict[int, tuple[float, float, float]]) -> tuple[int, int]:
    """The rows up to which torch's kernels and the integer one beat the float product."""
    against_torch = {r: (f, t) for r, (f, t, _) in times.items()}
    against_integer = {r: (f, i) for r, (f, _, i) in times.items()}
    return measure.crossover_from(against_torch), measure.crossover_from(against_integer)


def _load() -> str:
    """The 1, 5 and 15 minute load averages: other jobs on the machine show there."""
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def _name(fmt: str, group: int) -> str:
    return fmt if fmt == "int8" else f"{fmt} g{group}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=("bfloat16", "float32"))
    p.add_argument("--rows", default=",".join(map(str, ROWS)))
    p.add_argument("--repeats", type=int, default=REPEATS)
    p.add_argument("--formats", default="int4,int8", help="int4 (g32) and/or int8")
    a = p.parse_args()
    dtype = getattr(torch, a.dtype)
    torch.set_num_threads(a.threads)
    chosen = cpu.select()
    print(f"CPU {isa.cpu_model()!r}, kernels ISA {chosen}, {a.threads} threads, {a.dtype}")
    print(f"load average at start: {_load()}")
    print("whole step (30 layers + LM head), ms: rows, float, torch's, integer (float / each)")
    rows = sorted(int(r) for r in a.rows.split(","))
    formats = a.formats.split(",")
    for fmt, group in (v for v in VARIANTS if v[0] in formats):
        times = step_times(fmt, group, dtype, rows, a.repeats)
        torch_rows, integer_rows = crossovers(times)
        name = _name(fmt, group)
        print(
            f"  {name}: torch's kernels win up to {torch_rows} rows, the integer one {integer_rows}"
        )
    print(f"load average at end: {_load()}")


if __name__ == "__main__":
    main()
