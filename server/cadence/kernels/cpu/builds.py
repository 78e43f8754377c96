"""The builds of `cpu_kernels.cpp`, one shared library per instruction set (`isa.ISAS`),
compiled by the machine's C++ compiler (`$CXX`, default g++) with OpenMP into
`~/.cache/cadence/kernels/` (or `$CADENCE_KERNEL_CACHE`), keyed by a hash of the source,
the flags and the compiler, so an edited source or another compiler builds anew."""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from cadence.kernels.cpu import isa as isas

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
# -fno-trapping-math: loops with a select or a min/max around fast_exp (greedy's sum, the
# generic SwiGLU) vectorize without AVX-512's masked stores (avx2 greedy: 1.5 -> 0.43 ms at
# 32 x 49152); no FP exception flag is ever read here.
BASE_FLAGS = ("-O3", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC", "-std=c++17")


class KernelBuildError(RuntimeError):
    pass


def cache_dir() -> Path:
    configured = os.environ.get("CADENCE_KERNEL_CACHE")
    return Path(configured) if configured else Path.home() / ".cache/cadence/kernels"


def _compiler() -> str:
    cxx = os.environ.get("CXX", "g++")
    path = shutil.which(cxx)
    if path is None:
        raise KernelBuildError(f"no C++ compiler ({cxx!r} is not on PATH)")
    return path


def flags(isa: str) -> tuple[str, ...]:
    return (*BASE_FLAGS, *isas.compile_flags(isa))


def library_path(isa: str) -> Path:
    """Where the build of this source for `isa`, by this compiler, lives."""
    cxx = _compiler()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(flags(isa)).encode(), version.encode()):
        key.update(part)
    key.update(platform.machine().encode())
    return cache_dir() / f"cpu_kernels-{isa}-{key.hexdigest()[:16]}.so"


def build(isa: str) -> Path:
    """Compiles the kernels for `isa` unless this exact build exists; atomic (a temp file
    renamed into place), so concurrent shards never load a half-written library."""
    target = library_path(isa)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [_compiler(), *flags(isa), "-o", tmp, str(SOURCE)], capture_output=True, text=True
        )
        if done.returncode != 0:
            raise KernelBuildError(
                f"compiling {SOURCE.name} for {isa} failed:\n{done.stderr[-2000:]}"
            )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
