"""Which instruction set's build of the kernels the operators call: chosen once, at start,
from what the CPU reports (`select`, `--cpu-isa`, `$CADENCE_CPU_ISA`), else on first ask
(`available`); the tests switch it per instruction set (`selected`)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from cadence import cpu_isa as isas
from cadence.kernels.cpu import ops
from cadence.kernels.cpu_builds import KernelBuildError, build

_lock = threading.Lock()
_selected: str | None = None
_error: str | None = None


def library(isa: str) -> Path:
    """The library of `isa` (built first if needed); the CPU must run `isa`."""
    lacking = isas.missing(isa)
    if lacking:
        raise isas.IsaError(f"this CPU cannot run the {isa} kernels: lacks {lacking}")
    with _lock:  # one build at a time in this process (the file rename makes it atomic)
        return build(isa)


def select(requested: str | None = None) -> str:
    """Makes the kernels of `requested` ("auto", an instruction set, or None for
    $CADENCE_CPU_ISA) the ones every operator calls; returns the instruction set.
    Raises IsaError for one the CPU lacks, KernelBuildError when the kernels or the
    operators cannot be built."""
    global _selected, _error
    try:
        chosen = isas.resolve(requested)
        ops.use(chosen, library(chosen))
    except (KernelBuildError, isas.IsaError) as e:
        _error = str(e)
        raise
    _selected, _error = chosen, None
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


def available() -> bool:
    """True when the kernels and the operators are built (or build now) and load: selects
    the kernels on the first call ($CADENCE_CPU_ISA, else the best the CPU runs); a failed
    selection is not tried again."""
    if _selected is not None:
        return True
    if _error is not None:
        return False
    try:
        select()
    except (KernelBuildError, isas.IsaError):
        return False
    return True


def unavailable_reason() -> str | None:
    return None if available() else _error


def not_selectable(isa: str) -> str | None:
    """Why the kernels of `isa` cannot run here (the CPU lacks its flags, or there are no
    kernels at all), else None: what a test of `isa`'s kernels is skipped with."""
    lacking = isas.missing(isa)
    if lacking:
        return f"this CPU lacks {', '.join(lacking)} for the {isa} kernels"
    if not available():
        return f"no CPU kernels: {unavailable_reason()}"
    return None
