"""Up to how many rows a quantized product beats the float one, per weight format,
activation dtype and CPU instruction set.

Torch's weight-only kernels read 2x (int8) or 4x (int4) fewer weight bytes, which wins
while a product is bound by reading its weight (decode: a few rows); with more rows the
float product's blocked GEMM (oneDNN, weight prepacked) computes faster than their
dequantize-as-you-go loops. A layer holding both takes the quantized kernel up to the
crossover and the float weight above it. Where the C++ integer product serves
(`cadence.quant.cpu_gemm`: VNNI dot products on int8 activations) it computes faster
than oneDNN's bfloat16 GEMM too, at every row count measured (1 to 512): its crossover is
ALL_ROWS and no float copy is kept.

`DEFAULTS` were measured on a 2-core AMD EPYC with AVX-512 BF16 over a whole
SmolLM2-135M step's products (`benchmarks/kernels/quant_linear_bench.py`, docs/quantization.md), the
float32 rows also with torch, oneDNN and MKL held to AVX2; the bench writes the table for
the machine it runs on to `<cache dir>/quant_crossover.json`, which shards read instead
when present. Torch's bfloat16 kernels change blocking above 4 rows (their time nearly
doubles from 4 to 6), which is where their bfloat16 crossover sits; against float32
products, twice as slow as bfloat16 ones, they win further.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from cadence.model_source import cache_dir

FILE_NAME = "quant_crossover.json"
FORMATS = ("int8", "int4")
# The quantized kernel won at every row count measured, prefill-sized ones included: no
# product is sent to a float weight, so none is kept (`/info` shows "all").
ALL_ROWS = 1 << 30

# (format, activation dtype, ISA) -> most rows the quantized kernel serves.
DEFAULTS: dict[tuple[str, str, str], int] = {
    # the integer product (VNNI) wins at every row count measured, 1 to 512
    ("int8", "bfloat16", "avx512_bf16"): ALL_ROWS,
    ("int4", "bfloat16", "avx512_bf16"): ALL_ROWS,
    ("int8", "float32", "avx512_bf16"): ALL_ROWS,
    ("int4", "float32", "avx512_bf16"): ALL_ROWS,
    # the integer product's AVX2 tiles (vpmaddubsw), measured held to AVX2: int4 wins at
    # every row count measured (1 to 320), int8 up to 128
    ("int8", "float32", "avx2"): 128,
    ("int4", "float32", "avx2"): ALL_ROWS,
    # torch's weight-only kernels, not measured (no such CPU here): what they measured held
    # to AVX2 before the integer product, the narrower of the two
    ("int8", "float32", "avx512"): 4,
    ("int4", "float32", "avx512"): 8,
}
FALLBACK_ROWS = 4  # a combination nobody measured: decode-sized batches only


def table_path() -> Path:
    return cache_dir() / FILE_NAME


def _key(fmt: str, dtype: str, isa: str) -> str:
    return f"{fmt}/{dtype}/{isa}"


@dataclass(frozen=True, slots=True)
class Crossover:
    rows: int
    source: str  # "measured (<file>)", "default" or "fallback": what /info shows


def rows_text(rows: int) -> str:
    """A crossover as /info and the start-up log show it."""
    return "all" if rows >= ALL_ROWS else str(rows)


def format_of(description: str) -> str:
    """ "int4 g128" -> "int4"."""
    return description.split()[0]


def crossover_rows(fmt: str, dtype: str, isa: str, path: Path | None = None) -> Crossover:
    """The crossover for `fmt` ("int8"/"int4") under `dtype` activations on `isa` (a
    name of `cadence.cpu_isa.ISAS`, "cuda" on a GPU): the measured table's entry
    when the file has one, else the built-in default."""
    path = table_path() if path is None else path
    if path.exists():
        measured = json.loads(path.read_text()).get("crossover", {})
        if _key(fmt, dtype, isa) in measured:
            return Crossover(int(measured[_key(fmt, dtype, isa)]), f"measured ({path})")
    if (fmt, dtype, isa) in DEFAULTS:
        return Crossover(DEFAULTS[(fmt, dtype, isa)], "default")
    return Crossover(FALLBACK_ROWS, "fallback")


def write_table(
    entries: dict[tuple[str, str, str], int], cpu: str, path: Path | None = None
) -> Path:
    """Merges measured `entries` into the table file (keeping other ISAs' entries)."""
    path = table_path() if path is None else path
    data = json.loads(path.read_text()) if path.exists() else {}
    crossover = data.get("crossover", {})
    crossover.update({_key(*k): v for k, v in entries.items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"cpu": cpu, "crossover": crossover}, indent=2) + "\n")
    return path
