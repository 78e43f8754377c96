"""`python -m cadence.kernels.cpu`: builds the CPU kernels for every instruction set this
architecture has (not only the ones this CPU runs, so the tests of each path and a
machine sharing the cache find them) and the operator shim over them, ahead of the first
launch, in parallel."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cadence import cpu_isa as isa
from cadence.kernels.cpu_builds import KernelBuildError, build, build_operators


def _build(job: tuple[str, Callable[[], Path]]) -> str:
    name, run = job
    try:
        return f"  {name}: {run()}"
    except KernelBuildError as e:
        return f"  {name}: not built ({e})"


jobs: list[tuple[str, Callable[[], Path]]] = [("operators", build_operators)]
jobs += [(name, lambda name=name: build(name)) for name in isa.buildable()]
with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
    lines = list(pool.map(_build, jobs))
print(f"CPU kernels (this CPU runs {', '.join(isa.supported())}):", *lines, sep="\n")
operators, *kernels = lines
if "not built" in operators or all("not built" in line for line in kernels):
    # Not fatal: the shard falls back to the torch attention backend.
    print("no CPU kernels usable; the shard will use the torch backend", file=sys.stderr)
