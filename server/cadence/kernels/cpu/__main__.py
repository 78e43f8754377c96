"""`python -m cadence.kernels.cpu`: builds the CPU kernels for every instruction set this
CPU runs (each one the tests of its path load) and the operator shim over them, ahead of
the first launch, in parallel. The others are not built: `selection.library` refuses an
instruction set the CPU lacks, and on an AVX2-only CPU the two AVX-512 builds took cores
from the router's compilation during a fresh install. `--all` builds every instruction set
of this architecture (the Docker image, which runs on whatever CPU it lands on)."""

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
wanted = isa.buildable() if "--all" in sys.argv[1:] else isa.supported()
jobs += [(name, lambda name=name: build(name)) for name in wanted]
with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
    lines = list(pool.map(_build, jobs))
print(f"CPU kernels (this CPU runs {', '.join(isa.supported())}):", *lines, sep="\n")
operators, *kernels = lines
if "not built" in operators or all("not built" in line for line in kernels):
    # Not fatal: the shard falls back to the torch attention backend.
    print("no CPU kernels usable; the shard will use the torch backend", file=sys.stderr)
