"""What runs each kernel family of a shard, for its start-up log line and Info."""

from __future__ import annotations

import torch

from cadence.kernels import cpu as cpu_kernels
from cadence.layers.packed import BF16_PACKED_MAX_ROWS


def kernel_paths(
    device: torch.device, dtype: torch.dtype, attention_backend: str, packed_bytes: int
) -> dict[str, str]:
    """{"isa", "attention", "products", "norms", "sampling"} -> what serves each."""
    if device.type != "cpu":
        return {
            "isa": "",
            "attention": attention_backend,
            "products": f"torch {_name(dtype)}",
            "norms": "torch",
            "sampling": "torch",
        }
    isa = cpu_kernels.selected_isa()
    kernels_on = cpu_kernels.enabled_for(torch.empty(0, dtype=dtype))
    cxx = f"C++ {isa}" if kernels_on else "torch"
    if attention_backend == "cpu":
        attention = f"C++ {isa} paged decode, torch SDPA prefill"
    else:
        attention = "torch gather + SDPA" if attention_backend == "torch" else attention_backend
    products = f"torch {_name(dtype)}"
    if packed_bytes:
        rows = "" if dtype == torch.float32 else f" up to {BF16_PACKED_MAX_ROWS} rows, else torch"
        products = f"oneDNN {_name(dtype)} prepacked{rows}"
    return {
        "isa": isa or "none (" + (cpu_kernels.unavailable_reason() or "not loaded") + ")",
        "attention": attention,
        "products": products,
        "norms": cxx,
        "sampling": f"{cxx} greedy, torch otherwise" if kernels_on else "torch",
    }


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def log_line(paths: dict[str, str]) -> str:
    return "kernels: " + "; ".join(f"{family} {path}" for family, path in paths.items())
