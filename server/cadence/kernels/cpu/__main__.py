"""`python -m cadence.kernels.cpu`: builds the CPU kernels ahead of the first launch."""

from __future__ import annotations

import sys

from cadence.kernels.cpu import KernelBuildError, build

try:
    print(f"CPU kernels: {build()}")
except KernelBuildError as e:
    # Not fatal: the shard falls back to the torch attention backend.
    print(f"CPU kernels not built ({e}); the shard will use the torch backend", file=sys.stderr)
