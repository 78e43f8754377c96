"""Which instruction set's build of the kernels the operators call: chosen once, at start,
from what the CPU reports (`select`, `--cpu-isa`, `$CADENCE_CPU_ISA`), else on first use;
the tests switch it per instruction set (`selected`)."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from cadence.kernels.cpu import isa as isas
from cadence.kernels.cpu.builds import KernelBuildError, build

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL] = {}
_current: ctypes.CDLL | None = None  # the selected instruction set's library
_selected: str | None = None
_error: str | None = None


def library(isa: str) -> ctypes.CDLL:
    """The loaded library of `isa` (built first if needed); the CPU must run `isa`. Its
    entry points are called by the operators of `ops.py` only."""
    with _lock:
        if isa not in _loaded:
            lacking = isas.missing(isa)
            if lacking:
                raise isas.IsaError(f"this CPU cannot run the {isa} kernels: lacks {lacking}")
            try:
                _loaded[isa] = ctypes.CDLL(str(build(isa)))
            except OSError as e:
                raise KernelBuildError(f"loading the {isa} kernels failed: {e}") from e
        return _loaded[isa]


def select(requested: str | None = None) -> str:
    """Makes the kernels of `requested` ("auto", an instruction set, or None for
    $CADENCE_CPU_ISA) the ones every operator calls; returns the instruction set.
    Raises IsaError for one the CPU lacks, KernelBuildError when they cannot be built."""
    global _current, _selected, _error
    try:
        chosen = isas.resolve(requested)
        lib = library(chosen)
    except (KernelBuildError, isas.IsaError) as e:
        _error = str(e)
        raise
    _current, _selected, _error = lib, chosen, None
    return chosen


@contextmanager
def selected(isa: str) -> Iterator[str]:
    """Runs the block with the kernels of `isa` (tests of every path), then restores the
    previous choice."""
    previous = _selected
    select(isa)
    try:
        yield isa
    finally:
        select(previous)


def selected_isa() -> str | None:
    """The instruction set of the kernels in use (None before any is loaded)."""
    return _selected


def current() -> ctypes.CDLL:
    """The library in use, selected on first call ($CADENCE_CPU_ISA, else the best the
    CPU runs); a failed selection is raised again without another try."""
    if _current is not None:  # every kernel call comes here: no lock once loaded
        return _current
    if _error is not None:
        raise KernelBuildError(_error)
    select()
    assert _current is not None
    return _current


def available() -> bool:
    """True when the kernels are built (or build now) and load."""
    try:
        current()
    except (KernelBuildError, isas.IsaError):
        return False
    return True


def unavailable_reason() -> str | None:
    return None if available() else _error
