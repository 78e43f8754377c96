"""Quantized products (int8 per channel, int4 per group) against the float products a
shard serves (oneDNN, weight prepacked), on SmolLM2-135M's shapes, and the crossover
row count the shards dispatch by (`cadence.quant.crossover`).

Prints, per checkpoint shape, the time of one product at each row count; then, over a
whole step's worth of distinct weights (30 layers + LM head), the crossover per format.
The quantized side is the kernel a shard would use here (the C++ integer product where the
selected kernels have VNNI, else torch's weight-only kernels); `--torch-kernels` times
torch's whatever the CPU.
`--write` stores the crossovers for this CPU's instruction set in
`<cache dir>/quant_crossover.json`, which shards then read. Hold the libraries to AVX2
with `ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2
CADENCE_CPU_ISA=avx2` (and `--dtype float32`, what is served there).

    python benchmarks/kernels/quant_linear_bench.py [--threads 2] [--dtype bfloat16] [--write]
        [--torch-kernels]
"""

from __future__ import annotations

import argparse

import torch
from cadence import cpu_isa as isa
from cadence.kernels import cpu
from cadence.quant import crossover, measure

PRODUCT_ROWS = (1, 4, 16, 32, 64, 320)
CROSSOVER_ROWS = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256, 512)
REPEATS = 15  # passes per measurement: the fastest call of each product counts
VARIANTS = (("int8", 0), ("int4", 32), ("int4", 128))  # (format, group size)


def per_product(dtype: torch.dtype, rows: tuple[int, ...], torch_kernels: bool) -> None:
    """Each checkpoint shape as 30 distinct weights (a model's worth, streamed from
    memory as in a step; the LM head once): the time of one product."""
    print(f"one product, ms (float = oneDNN {dtype} as served):")
    print(f"{'shape':>12} {'rows':>5} {'float':>8}" + "".join(f"{_name(v):>10}" for v in VARIANTS))
    for shape in measure.SMOLLM2_PRODUCT_SHAPES:
        copies = 1 if shape == measure.SMOLLM2_HEAD else measure.SMOLLM2_LAYERS
        built = [
            measure.build(
                [shape] * copies, fmt, group, dtype, measure.torch_kernel if torch_kernels else None
            )
            for fmt, group in VARIANTS
        ]
        for r in rows:
            # one LM head is a single call per pass: more passes to find a quiet one
            repeats = REPEATS if copies > 1 else 4 * REPEATS
            times = [measure.time_rows(b, r, dtype, repeats=repeats) for b in built]
            cells = "".join(f"{q / copies * 1e3:10.3f}" for _, q in times)
            float_ms = min(f for f, _ in times) / copies * 1e3  # timed beside each variant
            print(f"{shape[0]:>6}x{shape[1]:<5} {r:>5} {float_ms:8.3f}{cells}")


def _name(variant: tuple[int, int] | tuple[str, int]) -> str:
    fmt, group = variant
    return str(fmt) if fmt == "int8" else f"{fmt} g{group}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--rows", default=",".join(map(str, PRODUCT_ROWS)))
    p.add_argument("--skip-products", action="store_true", help="only the crossover")
    p.add_argument("--write", action="store_true", help="store the crossovers in the cache")
    p.add_argument("--torch-kernels", action="store_true", help="torch's weight-only kernels")
    a = p.parse_args()
    dtype = getattr(torch, a.dtype)
    torch.set_num_threads(a.threads)
    cpu.available()  # selects the C++ kernels ($CADENCE_CPU_ISA, else the CPU's best)
    chosen = cpu.selected_isa() or isa.resolve()
    kernels = "torch's" if a.torch_kernels else "as served"
    print(
        f"CPU {isa.cpu_model()!r}, kernels ISA {chosen}, {a.threads} threads, {a.dtype}, "
        f"quantized kernels {kernels}"
    )
    if not a.skip_products:
        per_product(dtype, tuple(int(r) for r in a.rows.split(",")), a.torch_kernels)
    print("whole step (30 layers + LM head), ms: rows float quantized (ratio)")
    found: dict[tuple[str, str, str], int] = {}
    for fmt, group in VARIANTS:
        rows, times = measure.measure_crossover(
            fmt, dtype, group, CROSSOVER_ROWS, REPEATS, a.torch_kernels
        )
        for r, (f, q) in times.items():
            print(f"  {_name((fmt, group)):>9} {r:>4} {f * 1e3:8.2f} {q * 1e3:8.2f} ({f / q:.2f}x)")
        print(f"  {_name((fmt, group))}: quantized wins up to {crossover.rows_text(rows)} rows")
        key = (fmt, a.dtype, chosen)
        found[key] = min(found.get(key, rows), rows)  # int4: the smaller over the groups
    if a.write:
        print(f"wrote {crossover.write_table(found, isa.cpu_model())}")


if __name__ == "__main__":
    main()
