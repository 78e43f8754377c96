"""A loaded model's quantization, as the shard's flags ask: a pre-quantized source's
weights placed, or a float checkpoint's linears quantized; and the dict /info shows."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from loguru import logger
from torch import nn

from cadence.quant import calibrate, kv_calibrate
from cadence.quant.checkpoints import QuantizedSource
from cadence.quant.crossover import ALL_ROWS, FORMATS, Crossover, crossover_rows
from cadence.quant.load import (
    Dispatch,
    load_from_source,
    quantizable,
    quantize_model,
    summary,
)
from cadence.quant.product import ProductKernels

# auto keeps the float weights on CPU while they take at most this share of MemAvailable
KEEP_FLOAT_MEMORY_SHARE = 0.5


@dataclass(frozen=True, slots=True)
class QuantizeConfig:
    method: str | None = None  # "int8" | "int4": quantize a float checkpoint at load
    group_size: int = 32  # int4 group (smaller where a layer's input does not divide)
    keep_float: str = "auto"  # one of cadence.config.KEEP_FLOAT_CHOICES
    # the shard's product kernels (`cadence.shard.backends.product_kernels`); a model
    # with quantized weights needs them
    products: ProductKernels | None = None
    # batch-invariant serving: the quantized kernel serves every row count (a float copy
    # above a crossover would give a row other bits in a larger step)
    one_kernel: bool = False
    # the kernel table (`cadence.quant.calibrate`): a format whose measured kernel is the
    # float copy is served by it at every row count; "": the integer product's defaults
    kernel_table: str = ""


def float_linear_bytes(model: nn.Module) -> int:
    """Bytes of the float weights the quantizable layers hold (tied ones once)."""
    seen = {id(m.weight): m.weight for m in model.modules() if quantizable(m)}
    return sum(w.numel() * w.element_size() for w in seen.values())


def keeps_float(setting: str, device: torch.device, float_bytes: int) -> bool:
    """auto: on CPU while the float copies fit in KEEP_FLOAT_MEMORY_SHARE of the memory
    available; never on a GPU (its memory is what quantization saves there)."""
    if setting != "auto":
        return setting == "on"
    if device.type != "cpu":
        return False
    from cadence.shard.memory import available_bytes

    return float_bytes <= KEEP_FLOAT_MEMORY_SHARE * available_bytes(device)


def isa_name(device: torch.device) -> str:
    """The crossover table's ISA key: the C++ kernels' instruction set, "cuda" on a GPU."""
    if device.type == "cuda":
        return "cuda"
    from cadence.kernels import cpu as cpu_kernels

    return cpu_kernels.selected_isa() or "scalar"


def measured_kernels(
    cfg: QuantizeConfig, device: torch.device, dtype_name: str
) -> dict[str, tuple[str, str]]:
    """format -> (kernel, what /info says of it) from the kernel table, for this machine's
    entry (else the file's only one: a table handed over from another machine); {} on a
    GPU or without a table."""
    if cfg.products is ProductKernels.TRITON:
        return {}
    table = _machine_table(cfg.kernel_table, device, dtype_name)
    if table is None:
        return {}
    use_measured_tiles(table)
    return {fmt: (m.kernel, calibrate.describe(table, fmt)) for fmt, m in table.formats.items()}


def amx_available() -> bool:
    """Whether this process may run the AMX product (the avx512_bf16 kernels loaded, the CPU
    has AMX-INT8, the kernel granted it)."""
    try:
        return bool(torch.ops.cadence.amx_available())
    except (AttributeError, RuntimeError):  # no C++ kernels loaded here
        return False


def use_measured_tiles(table: calibrate.KernelTable) -> None:
    """The integer product of each format on the tiles the table measured fastest: AMX's
    where they won and this process may use them (the vector tiles otherwise, which give
    the same bits, with one line saying why)."""
    from cadence.quant import cpu_gemm

    for fmt, m in table.formats.items():
        if fmt not in cpu_gemm.FORMAT_CODES:
            continue
        if m.kernel != calibrate.INTEGER or m.tiles != calibrate.AMX:
            cpu_gemm.use_tiles(fmt, cpu_gemm.VECTOR_TILES)
        elif amx_available():
            cpu_gemm.use_tiles(fmt, cpu_gemm.AMX_TILES)
        else:
            cpu_gemm.use_tiles(fmt, cpu_gemm.VECTOR_TILES)
            logger.warning(
                f"{fmt}: the kernel table chose AMX tiles but this process may not use them "
                "(no AMX-INT8, or the kernel refused it): the vector tiles serve, same answers"
            )


# (file, key) pairs already said to have no entry: each read of a start says it once
_UNMATCHED: set[tuple[str, str]] = set()


def read_table(kernel_table: str, key: str) -> calibrate.KernelTable | None:
    """The file's table for `key` (else its only one: handed over from another machine).
    Where the file holds tables but none of them for `key` (other machines, dtypes or
    kernel builds: an edit of the kernels' sources changes the key), says so once, for the
    built-in defaults serve instead of anything measured."""
    path = Path(kernel_table)
    table = calibrate.read_for_machine(path, key)
    if table is None and path.exists() and (str(path), key) not in _UNMATCHED:
        _UNMATCHED.add((str(path), key))
        logger.warning(
            f"the kernel table {path} holds no measurement for {key!r}: the built-in "
            "defaults serve (`cadence calibrate --output FILE` measures this machine)"
        )
    return table


def _machine_table(
    kernel_table: str, device: torch.device, dtype: str
) -> calibrate.KernelTable | None:
    """This machine's entry for `dtype` in the table file (None: no file, not a CPU)."""
    if not kernel_table or device.type != "cpu":
        return None
    return read_table(kernel_table, calibrate.machine_key(isa_name(device), dtype))


def use_measured_attention_tiles(
    kernel_table: str, device: torch.device, dtype_name: str, kv_cache_dtype: str
) -> str:
    """Runs an int8 cache's attention on AMX-INT8 tiles for the calls the table measured
    them faster in here (bitwise the vector kernel's answers either way), where this
    process may run them (the vector kernel otherwise, with one line saying why); returns
    what /info says of it ("" where the tiles serve nothing)."""
    table = _machine_table(kernel_table, device, dtype_name)
    if device.type != "cpu" or isa_name(device) != "avx512_bf16":
        return ""  # only these kernels have the tiles (and the operator to ask)
    torch.ops.cadence.use_attention_tiles(kv_calibrate.VECTOR_TILES, 1)
    kv = table.kv_cache if table is not None else None
    if kv is None or kv_cache_dtype != kv_calibrate.INT8 or kv.tiles_min_rows == 0:
        return ""
    if not amx_available():
        logger.warning(
            "the kernel table chose AMX tiles for the int8 KV cache's attention but this "
            "process may not use them (no AMX-INT8, or the kernel refused it): the vector "
            "kernel serves, same answers"
        )
        return ""
    torch.ops.cadence.use_attention_tiles(kv_calibrate.AMX_TILES, kv.tiles_min_rows)
    return kv_calibrate.tiles_text(kv)


def use_measured_bf16_product(kernel_table: str, device: torch.device) -> str:
    """Serves bfloat16 products on cadence's AMX-BF16 tiles where the table measured them
    faster than oneDNN on this machine and this process may run them (oneDNN otherwise,
    with one line saying why), and returns what /info says of it ("" without a bfloat16
    measurement here)."""
    from cadence.layers import packed as packing
    from cadence.quant import float_calibrate

    packing.use_bf16_product(None)
    table = _machine_table(kernel_table, device, "bfloat16")
    if table is None or table.bf16 is None:
        return ""
    if table.bf16.choice == float_calibrate.AMX_BF16 and not packing.amx_bf16_usable():
        logger.warning(
            "the kernel table chose AMX-BF16 tiles for bfloat16 products but this process may "
            "not use them (no AMX-BF16, or the kernel refused it): oneDNN serves"
        )
        return ""
    packing.use_bf16_product(table.bf16.choice)
    return float_calibrate.describe_bf16(table.bf16)


def use_measured_float_product(kernel_table: str, device: torch.device) -> str:
    """Serves float32 products by the kernel the table measured faster on this machine
    (cadence's tiles or oneDNN, `cadence.quant.float_calibrate`), and returns what /info
    says of it; "" (the instruction set's default) without a float32 measurement here."""
    from cadence.layers import packed as packing
    from cadence.quant import float_calibrate

    packing.use_float_product(None)
    table = _machine_table(kernel_table, device, "float32")
    if table is None or table.float32 is None:
        return ""
    packing.use_float_product(table.float32.choice)
    return float_calibrate.describe(table.float32)


def measured_kv_cache(kernel_table: str, device: torch.device, dtype_name: str) -> str:
    """What the kernel table measured of the KV cache here (`kv_calibrate.describe`), for
    /info; "" without a table or a measurement."""
    table = _machine_table(kernel_table, device, dtype_name)
    if table is None or table.kv_cache is None:
        return ""
    return kv_calibrate.describe(table.kv_cache)


def dispatch_for(
    cfg: QuantizeConfig, model: nn.Module, dtype: torch.dtype, device: torch.device
) -> tuple[Dispatch, dict[str, str]]:
    """The dispatch for `model`, and where each format's crossover came from. auto keeps
    no float copy of a layer whose quantized kernel wins at every row count (nothing would
    read it); "on" keeps every one."""
    if cfg.products is None:
        raise ValueError("quantized weights need the shard's product kernels (products)")
    dtype_name = str(dtype).removeprefix("torch.")
    isa = isa_name(device)
    found = {fmt: crossover_rows(fmt, dtype_name, isa) for fmt in FORMATS}
    if cfg.one_kernel:
        found = {fmt: Crossover(ALL_ROWS, "one kernel: --deterministic") for fmt in FORMATS}
    keep = keeps_float(cfg.keep_float, device, float_linear_bytes(model))
    measured = measured_kernels(cfg, device, dtype_name)
    floats = {fmt: why for fmt, (kernel, why) in measured.items() if kernel == calibrate.FLOAT}
    if floats and keep:  # where the float copies fit (auto) or are asked for (on)
        found |= {fmt: Crossover(0, why) for fmt, why in floats.items()}
    for fmt, (kernel, why) in measured.items():
        if kernel == calibrate.INTEGER:
            found[fmt] = Crossover(found[fmt].rows, f"{found[fmt].source}; {why}")
    rows = {fmt: c.rows for fmt, c in found.items()}
    dispatch = Dispatch(keep, cfg.products, rows, keep_float_always=cfg.keep_float == "on")
    return dispatch, {fmt: c.source for fmt, c in found.items()}


def apply(
    model: nn.Module,
    source: QuantizedSource | None,
    cfg: QuantizeConfig,
    dtype: torch.dtype,
    device: torch.device,
) -> dict[str, Any]:
    """Loads `source` into `model` (whose float weights are still empty), or quantizes
    `model`'s loaded float weights when `cfg.method` is set. Returns what /info shows."""
    if source is None and not cfg.method:
        return {}
    dispatch, origin = dispatch_for(cfg, model, dtype, device)
    if source is not None:
        if cfg.method:
            raise ValueError(
                f"the checkpoint is already quantized ({source.description}): "
                "serve it without --quantize"
            )
        load_from_source(model, source, dispatch)
        description = source.description
    elif cfg.method:
        quantize_model(model, cfg.method, cfg.group_size, dispatch)
        description = f"{cfg.method} at load" + (
            f" (group {cfg.group_size}, LM head int8)" if cfg.method == "int4" else ""
        )
    info = summary(model)
    used = {f.split()[0] for f in info.get("formats", {})}
    return {
        "source": description,
        **info,
        "crossover": {f: {"rows": dispatch.crossover[f], "from": origin[f]} for f in used},
    }
