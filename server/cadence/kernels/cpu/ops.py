"""The operators `torch.ops.cadence.*` from Python's side: they are defined and implemented
in C++ (`cpu_ops.cpp`, the operator shim: schemas, argument checks, CPU and Meta
implementations), so a call goes from the dispatcher straight to C++ with no Python in
between. This module only loads the shim into torch, once, and tells it which
instruction set's library to call (`selection.py` decides which).

The operators exist from the first selection on (`selection.select`, or `available()`):
before it, `torch.ops.cadence` has none of them.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from cadence.kernels.cpu_builds import KernelBuildError, build_operators

_lock = threading.Lock()
_loaded = False


def load() -> None:
    """Builds the shim unless built, and loads it (its operators registered with torch)
    unless loaded. Raises KernelBuildError when it cannot be built or loaded."""
    global _loaded
    with _lock:
        if _loaded:
            return
        path = build_operators()
        try:
            torch.ops.load_library(str(path))
        except OSError as e:
            raise KernelBuildError(f"loading the CPU operators ({path}) failed: {e}") from e
        _loaded = True


def use(isa: str, library: Path) -> None:
    """Makes every operator call the entry points of `library` (the kernels built for
    `isa`) from now on. Raises KernelBuildError when it does not load."""
    load()
    try:
        torch.ops.cadence._select_kernels(isa, str(library))
    except RuntimeError as e:
        raise KernelBuildError(str(e)) from e


def in_use() -> str:
    """The file of the entry points the operators call, as the dynamic linker names it
    ("" before any selection)."""
    load()
    return torch.ops.cadence._selected_kernels()
