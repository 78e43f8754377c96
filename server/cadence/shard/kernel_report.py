"""What runs each kernel family of a shard, for its start-up log line and Info."""

from __future__ import annotations

from typing import Any

import torch

from cadence.attention_backends import AttentionBackend
from cadence.kernels import cpu as cpu_kernels
from cadence.layers import packed as packing
from cadence.layers.kernel_ops import LayerOps
from cadence.layers.packed import BF16_PACKED_MAX_ROWS
from cadence.quant.crossover import rows_text
from cadence.runners import ModelRunner


def kernel_paths(
    device: torch.device,
    dtype: torch.dtype,
    attention: AttentionBackend[Any],
    ops: LayerOps,
    runner: ModelRunner,
    packed_bytes: int,
    quantization: dict[str, Any] | None = None,
    packed_every_row: bool = False,
    float_measured: str = "",
) -> dict[str, str]:
    """{"isa", "attention", "products", "norms", "sampling", "runner"} -> what serves each;
    `float_measured`: what the kernel table measured of the float products here."""
    isa = ""
    if device.type == "cpu":
        isa = cpu_kernels.selected_isa() or (
            "none (" + (cpu_kernels.unavailable_reason() or "not loaded") + ")"
        )
    products = f"torch {_name(dtype)}"
    if packed_bytes:
        every = dtype == torch.float32 or packed_every_row
        rows = "" if every else f" up to {BF16_PACKED_MAX_ROWS} rows, else torch"
        products = f"oneDNN {_name(dtype)} prepacked{rows}"
        if dtype == torch.float32 and packing.float_tiles_serve():
            products = f"C++ {isa} float32 tiles"
        if dtype == torch.bfloat16 and packing.amx_bf16_serves():
            products = f"C++ {isa} AMX-BF16 tiles"
        if float_measured:
            products += f", measured here: {float_measured}"
    if quantization:
        products = _quantized_products(quantization, products)
    return {
        "isa": isa,
        "attention": attention.description,
        "products": products,
        "norms": ops.norms,
        "sampling": ops.sampling,
        "runner": runner.description,
    }


def _quantized_products(quantization: dict[str, Any], float_path: str) -> str:
    """ "int4 g64 kernels up to 8 rows, above: oneDNN bfloat16 prepacked ..."."""
    kernels = ", ".join(sorted(quantization["formats"]))
    if not quantization["float_kept"]:
        return f"{kernels} kernels (no float copy kept)"
    crossovers = [c["rows"] for c in quantization["crossover"].values()]
    if crossovers and not any(crossovers):
        return f"{float_path} at every row count (measured faster here than the {kernels} kernels)"
    rows = "/".join(rows_text(c["rows"]) for c in quantization["crossover"].values())
    return f"{kernels} kernels up to {rows} rows, above: {float_path}"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def log_line(paths: dict[str, str]) -> str:
    return "kernels: " + "; ".join(f"{family} {path}" for family, path in paths.items())
