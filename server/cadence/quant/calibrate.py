"""Which kernel multiplies quantized weights on this machine, chosen by measuring it.

CPUs with the same instruction-set names differ: the integer product (int8 activations
against int4/int8 weights, VNNI) beats oneDNN's bfloat16 product on a Zen 4 or Zen 5, but
on a Sapphire Rapids oneDNN's bfloat16 product runs on AMX tiles and the float copy of
the same weights serves the charter workload faster. So the choice is measured on the
machine, once per (CPU model, cores, torch version, instruction set, dtype, build of the
C++ kernels), and cached in
`<cache dir>/kernel_table.json`: `cadence launch` measures it on its first start on a
machine (a few seconds; `cadence calibrate` does it on demand) and hands the file to its
shards (`--kernel-table`).

One kernel per format, not a crossover: batch-invariant serving (docs/determinism.md) needs
one kernel for every row count of a layer. Each side is timed over SmolLM2-135M's products
(`cadence.quant.measure`: CALIBRATION_LAYERS of its layers and its LM head, ~60 MB of
bfloat16 weights, more than a CPU's caches hold, so they stream as in a real step) at a
decode step's rows (32) and a prefill chunk's (320), weighted as the charter workload
mixes them (64 prompts of 320 tokens and ~9,200 tokens decoded 32 at a time: 288 decode
steps to 64 prefill chunks, 4.5 to 1). The
float copy is chosen only when it is FLOAT_MARGIN faster: it costs the memory of a float
copy, and a choice that flips with the noise of a shared machine would change answers
from one start to the next.

On a CPU with AMX-INT8 whose kernel grants it (and whose AMX product passes its self-test
in a process of its own, `cadence.kernels.cpu.amx_check`), the integer product is timed a
second time on AMX's tiles, and the faster tiles serve it: both give the same bits, so
this choice needs no margin.

Where bfloat16 weights serve on the avx512_bf16 kernels of a CPU with AMX-BF16 (a
bfloat16 model, a quantized model's float copy), the table holds which bfloat16 product
serves them, cadence's AMX-BF16 tiles or oneDNN's (`float_calibrate.measure_bf16`), oneDNN
timed in the products batch invariance splits it into (`cadence.shard.determinism`:
32-row products on a Sapphire Rapids), measured first for the same reason as below.

Where float32 weights serve (`--dtype float32`, and every float weight on the avx2
kernels), the table also holds which float32 product serves them, cadence's tiles or
oneDNN's (`cadence.quant.float_calibrate`), measured first, so that the float copy is
timed against the integer product on the float32 product that would serve it.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING

from cadence.model_source import cache_dir
from cadence.quant import float_calibrate, kv_calibrate
from cadence.quant.float_calibrate import FloatMeasured
from cadence.quant.kv_calibrate import DECODE_WEIGHT, KvMeasured

if TYPE_CHECKING:  # torch is imported where it is used: the launcher keys the table without it
    import torch

FILE_NAME = "kernel_table.json"
INTEGER, FLOAT = "integer", "float"
VECTOR, AMX = "vector", "amx"  # the integer product's tiles: VNNI/AVX2 vectors, AMX's
# The KV cache's measurements by machine key, beside the machines' product entries (a
# section of their own, so that a cadence from before them still reads the file).
KV_CACHE = "kv_cache"
FLOAT32 = "float32_products"  # the same for the float32 product's measurements
BF16 = "bfloat16_products"  # and the bfloat16 one's (AMX-BF16 tiles or oneDNN)
SECTIONS = (KV_CACHE, FLOAT32, BF16)
DECODE_ROWS, PREFILL_ROWS = 32, 320
FLOAT_MARGIN = 1.05  # the float copy must be this much faster to be chosen
REPEATS = 2  # timed passes per side and row count (the fastest counts)
FORMATS = ("int4", "int8")
CALIBRATION_LAYERS = 10


def machine_key(isa: str, dtype: str) -> str:
    """What a measurement holds for: "AMD EPYC (family 25 model 17: Zen 4), 2 cores,
    torch 2.9.1, avx512_bf16, bfloat16, kernels 4481add7cfca1ff7"."""
    from cadence import cpu_isa

    cores = len(os.sched_getaffinity(0))
    return (
        f"{cpu_isa.cpu_model()}, {cores} cores, torch {version('torch')}, {isa}, {dtype}, "
        f"kernels {kernels_build(isa)}"
    )


@functools.cache
def kernels_build(isa: str) -> str:
    """The build id of the C++ kernels for `isa` (a hash of their sources, flags and
    compiler): a table measured with other kernels is measured again. "none" where there
    are none (no compiler, not x86)."""
    from cadence.kernels import cpu_builds as builds

    try:
        return builds.library_path(isa).stem.rsplit("-", 1)[-1]
    except (KeyError, builds.KernelBuildError):
        return "none"


@dataclass(slots=True)
class Measured:
    """One format's measurement: seconds per pass over the step's products."""

    kernel: str  # INTEGER or FLOAT
    integer_s: dict[int, float]  # rows -> seconds, on the vector tiles
    float_s: dict[int, float]
    measured_at: str = ""
    tiles: str = VECTOR  # which tiles serve the integer product (VECTOR or AMX)
    amx_s: dict[int, float] = field(default_factory=dict)  # on AMX's tiles, where timed
    amx_note: str = ""  # why AMX was not timed, or its self-test's line


@dataclass(slots=True)
class KernelTable:
    """The choices measured for one machine key: the product kernel by weight format, and
    the KV cache dtype quantized serving defaults to (`kv_calibrate`), and for a float32
    key the float32 product (`float_calibrate`; None where it was not measured)."""

    key: str
    formats: dict[str, Measured] = field(default_factory=dict)
    kv_cache: KvMeasured | None = None
    float32: FloatMeasured | None = None
    bf16: FloatMeasured | None = None  # for a bfloat16 key on the avx512_bf16 kernels

    def kernel(self, fmt: str) -> str | None:
        measured = self.formats.get(fmt)
        return measured.kernel if measured else None


def kv_measured(table: KernelTable) -> bool:
    """Whether `table` holds the KV cache's measurement as this cadence takes it (one
    from before prompts were timed chose on the decode step alone)."""
    return table.kv_cache is not None and bool(table.kv_cache.prompt_seconds)


def table_path() -> Path:
    return cache_dir() / FILE_NAME


def mix(seconds: dict[int, float]) -> float:
    """A pass's cost in the charter workload's proportions."""
    return DECODE_WEIGHT * seconds[DECODE_ROWS] + seconds[PREFILL_ROWS]


def choose(integer_s: dict[int, float], float_s: dict[int, float]) -> str:
    return FLOAT if mix(float_s) * FLOAT_MARGIN < mix(integer_s) else INTEGER


def choose_tiles(vector_s: dict[int, float], amx_s: dict[int, float]) -> str:
    """The faster tiles for the integer product (no margin: they give the same bits)."""
    return AMX if amx_s and mix(amx_s) < mix(vector_s) else VECTOR


def read(path: Path, key: str) -> KernelTable | None:
    """The table measured for `key` in the file at `path`, if it holds one (its KV cache
    measurement None where it was written without one)."""
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    entry = data.get(key) if key not in SECTIONS else None
    if entry is None:
        return None
    kv = data.get(KV_CACHE, {}).get(key)
    float32 = data.get(FLOAT32, {}).get(key)
    bf16 = data.get(BF16, {}).get(key)
    formats = {
        fmt: Measured(
            m["kernel"],
            {int(r): s for r, s in m["integer_s"].items()},
            {int(r): s for r, s in m["float_s"].items()},
            m.get("measured_at", ""),
            m.get("tiles", VECTOR),
            {int(r): s for r, s in m.get("amx_s", {}).items()},
            m.get("amx_note", ""),
        )
        for fmt, m in entry.items()
    }
    kv_cache = KvMeasured(**kv) if kv else None
    return KernelTable(key, formats, kv_cache, _float_measured(float32), _float_measured(bf16))


def _float_measured(entry: dict | None) -> FloatMeasured | None:
    if not entry:
        return None
    return FloatMeasured(
        entry["choice"],
        {int(r): s for r, s in entry["tiles_s"].items()},
        {int(r): s for r, s in entry["onednn_s"].items()},
        entry.get("measured_at", ""),
    )


def read_for_machine(path: Path, key: str) -> KernelTable | None:
    """The table for `key`, else the file's only one (a table handed over from another
    machine with `--kernel-table`)."""
    table = read(path, key)
    if table is None and path.exists():
        entries = [name for name in json.loads(path.read_text()) if name not in SECTIONS]
        table = read(path, entries[0]) if len(entries) == 1 else None
    return table


def write(table: KernelTable, path: Path) -> None:
    """Merges `table` into the file (other machines' keys kept; of its own key, what it
    did not measure: a float32-only measurement keeps the formats and KV cache)."""
    data = json.loads(path.read_text()) if path.exists() else {}
    if table.formats or table.key not in data:
        data[table.key] = {fmt: asdict(m) for fmt, m in table.formats.items()}
    if table.kv_cache is not None:
        data.setdefault(KV_CACHE, {})[table.key] = asdict(table.kv_cache)
    if table.float32 is not None:
        data.setdefault(FLOAT32, {})[table.key] = asdict(table.float32)
    if table.bf16 is not None:
        data.setdefault(BF16, {})[table.key] = asdict(table.bf16)
    path.parent.mkdir(parents=True, exist_ok=True)
    # whole or not at all: a launch reading it meanwhile never sees half a file
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """Held by a launch while it reads the table at `path` and measures what it lacks:
    launches started at once on one machine (replicas, a test suite's workers) measure
    once, and the later ones serve the first one's choices. Where the folder cannot be
    written (a read-only image with its table baked in), nothing is locked: such a launch
    only reads."""
    import fcntl

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_name(f".{path.name}.lock"), "w")
    except OSError:
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def measure(
    isa: str,
    dtype_name: str,
    shapes: list[tuple[int, int]] | None = None,
    formats: tuple[str, ...] = FORMATS,
    kv_step: tuple[int, int, int] | None = kv_calibrate.CHARTER,
    kept: KernelTable | None = None,
) -> KernelTable:
    """Times the integer product and the float copy for each of `formats` over `shapes`
    (default: SmolLM2-135M's, CALIBRATION_LAYERS layers and the head), and an int8 KV
    cache against a float one at `kv_step` (a decode step's rows and tokens of context, a
    prompt's tokens; None: not), with
    the C++ kernels of `isa`; for float32, the float32 tiles against oneDNN first.

    `kept`: this machine's entry as cached, whose measurements are kept instead of taken
    again (a launch measures only what its entry lacks). A choice made on a machine then
    stays made: where two kernels nearly tie, measuring again may choose the other, and a
    server started after it would not answer bit for bit as one started before."""
    import torch

    from cadence.kernels import cpu as cpu_kernels
    from cadence.layers import packed as packing
    from cadence.quant import measure as timing

    cpu_kernels.select(isa)
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    table = KernelTable(machine_key(isa, dtype_name))
    if kept is not None:
        table.formats = {f: m for f, m in kept.formats.items() if f in formats}
        table.kv_cache, table.float32, table.bf16 = kept.kv_cache, kept.float32, kept.bf16
        formats = tuple(f for f in formats if f not in kept.formats)
        kv_step = None if kv_measured(kept) else kv_step
    layers = timing.SMOLLM2_LAYER_SHAPES * CALIBRATION_LAYERS + [timing.SMOLLM2_HEAD]
    if table.float32 is None and dtype_name == "float32":
        if float_calibrate.can_measure(isa):
            rows = (DECODE_ROWS, PREFILL_ROWS)
            table.float32 = float_calibrate.measure(isa, shapes or layers, rows, mix)
        elif isa in float_calibrate.TILE_ISAS:
            table.float32 = float_calibrate.only_tiles()
    amx = amx_usable(isa) if formats or (table.bf16 is None and dtype_name == "bfloat16") else None
    # oneDNN's bfloat16 product as batch-invariant serving splits it (in 32-row products on
    # a Sapphire Rapids' AMX), so that it is timed as it serves
    split = 0
    if dtype_name == "bfloat16" and packing.onednn_packs(dtype):
        from cadence.shard.determinism import SPLIT, packed_split

        split = packed_split(dtype)
        split = 0 if split >= SPLIT else split  # whole prefill chunks in one call
    if table.bf16 is None and dtype_name == "bfloat16" and isa == "avx512_bf16":
        usable = amx is not None and amx[0] and packing.amx_bf16_usable()
        rows = (DECODE_ROWS, PREFILL_ROWS)
        table.bf16 = (
            float_calibrate.measure_bf16(shapes or layers, rows, mix, split)
            if usable
            else float_calibrate.bf16_not_timed()
        )
    previous = packing.float_product_choice(), packing.bf16_product_choice()
    packing.use_float_product(table.float32.choice if table.float32 else previous[0])
    packing.use_bf16_product(table.bf16.choice if table.bf16 else previous[1])
    try:
        if formats:
            on_amx = packing.amx_bf16_serves()  # the float copy's own product: no split
            float_split = 0 if on_amx else split
            measure_formats(table, isa, dtype, shapes or layers, formats, amx, float_split)
    finally:
        packing.use_float_product(previous[0])
        packing.use_bf16_product(previous[1])
    if kv_step is not None:
        if amx is None and isa == "avx512_bf16":
            amx = amx_usable(isa)
        table.kv_cache = kv_calibrate.measure(dtype_name, *kv_step, amx=amx)
    return table


def measure_formats(
    table: KernelTable,
    isa: str,
    dtype: torch.dtype,
    layers: list[tuple[int, int]],
    formats: tuple[str, ...],
    amx_check: tuple[bool, str] | None = None,
    float_split: int = 0,
) -> None:
    """The integer product against the float copy for each of `formats`, into `table`;
    `amx_check`: `amx_usable(isa)`'s answer, where it was already asked; `float_split`: the
    rows per call batch invariance keeps the float copy's products to (0: one call)."""
    import torch

    from cadence.quant import cpu_gemm
    from cadence.quant import measure as timing

    amx, amx_note = amx_check or amx_usable(isa)
    if amx and not torch.ops.cadence.amx_available():  # the self-test's process had it
        amx, amx_note = False, "AMX tiles not timed: the kernel refused AMX permission"
    for fmt in formats:
        products = timing.build(layers, fmt, 32, dtype)
        products.float_products = [
            float_calibrate.split_calls(f, float_split) for f in products.float_products
        ]
        float_s, integer_s, amx_s = {}, {}, {}
        for rows in (DECODE_ROWS, PREFILL_ROWS):
            float_s[rows], integer_s[rows] = timing.time_rows(products, rows, dtype, REPEATS)
        if amx:
            cpu_gemm.use_tiles(fmt, cpu_gemm.AMX_TILES)
            try:
                for rows in (DECODE_ROWS, PREFILL_ROWS):
                    amx_s[rows] = timing.time_rows(products, rows, dtype, REPEATS)[1]
            finally:
                cpu_gemm.use_tiles(fmt, cpu_gemm.VECTOR_TILES)
        tiles = choose_tiles(integer_s, amx_s)
        kernel = choose(amx_s if tiles == AMX else integer_s, float_s)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        table.formats[fmt] = Measured(kernel, integer_s, float_s, stamp, tiles, amx_s, amx_note)


def amx_usable(isa: str) -> tuple[bool, str]:
    """Whether the integer product can be timed on AMX's tiles here, and the line why:
    only the avx512_bf16 kernels have them, and only a CPU whose AMX passes the self-test
    (in a process of its own: a CPU or hypervisor that mishandles AMX kills it)."""
    if isa != "avx512_bf16":
        return False, f"AMX tiles not timed: the {isa} kernels have none"
    from cadence.kernels.cpu import amx_check

    usable, why = amx_check.usable()
    return usable, why if usable else f"AMX tiles not timed: {why}"


def describe(table: KernelTable, fmt: str) -> str:
    """ "integer (integer 24.1 / float 28.3 ms a decode step, measured ...)"; "integer on
    AMX tiles (...)" where those serve it."""
    m = table.formats[fmt]
    on_amx = m.kernel == INTEGER and m.tiles == AMX
    amx = ""
    if m.amx_s:
        amx = f"; AMX tiles {m.amx_s[DECODE_ROWS] * 1e3:.1f} / {m.amx_s[PREFILL_ROWS] * 1e3:.1f} ms"
    elif m.amx_note:
        amx = f"; {m.amx_note}"
    return (
        f"{m.kernel}{' on AMX tiles' if on_amx else ''} (integer "
        f"{m.integer_s[DECODE_ROWS] * 1e3:.1f} / float "
        f"{m.float_s[DECODE_ROWS] * 1e3:.1f} ms at {DECODE_ROWS} rows, "
        f"{m.integer_s[PREFILL_ROWS] * 1e3:.1f} / {m.float_s[PREFILL_ROWS] * 1e3:.1f} ms at "
        f"{PREFILL_ROWS}{amx}; measured {m.measured_at} on {table.key})"
    )
