"""`python -m cadence.kernels.cpu`: builds the CPU kernels for every instruction set this
architecture has (not only the ones this CPU runs, so the tests of each path and a
machine sharing the cache find them), ahead of the first launch."""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor

from cadence.kernels.cpu import isa
from cadence.kernels.cpu.builds import KernelBuildError, build


def _build(name: str) -> str:
    try:
        return f"  {name}: {build(name)}"
    except KernelBuildError as e:
        return f"  {name}: not built ({e})"


with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
    lines = list(pool.map(_build, isa.buildable()))
print(f"CPU kernels (this CPU runs {', '.join(isa.supported())}):", *lines, sep="\n")
if all("not built" in line for line in lines):
    # Not fatal: the shard falls back to the torch attention backend.
    print("no CPU kernels built; the shard will use the torch backend", file=sys.stderr)
