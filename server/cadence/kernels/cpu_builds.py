"""The builds of the C++ kernels, by the machine's C++ compiler (`$CXX`, default g++), into
`~/.cache/cadence/kernels/` (or `$CADENCE_KERNEL_CACHE`), each keyed by a hash of its
sources, its flags and the compiler (and torch's version for the shim), so an edited
source, another compiler or another torch builds anew:

- `build(isa)`: the kernel sources (`SOURCES`: one per op family), one plain-C shared
  library per instruction set (`isa.ISAS`), with OpenMP and no torch;
- `build_operators()`: `cpu_ops.cpp`, the operator shim, once, with the machine's baseline
  flags (it has no vector code) against torch's headers and libraries.

Outside the `cpu` package, whose import loads torch, and torch-free until the shim is
built: the launcher keys its kernel table by the kernels' build (`library_path`) before
any shard starts, and importing torch there cost each launch 1.5 s.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from cadence import cpu_isa as isas

_HERE = Path(__file__).parent / "cpu"  # the C++ sources
# The kernel library's translation units, one per op family, compiled together per ISA.
SOURCES = tuple(
    _HERE / name
    for name in (
        "attention_kernels.cpp",
        "rotary_kernels.cpp",
        "elementwise_kernels.cpp",
        "sampling_kernels.cpp",
        "lora_kernels.cpp",
        "quant_kernels.cpp",
        "float_kernels.cpp",
        "bf16_kernels.cpp",
    )
)
OPS_SOURCE = _HERE / "cpu_ops.cpp"
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def local_files(sources: Sequence[Path]) -> tuple[Path, ...]:
    """`sources` and every file of this folder they include, transitively (`#include
    "..."`), in a fixed order: what a build's key hashes, so no header can be left out."""
    found: dict[Path, None] = {}
    pending = list(sources)
    while pending:
        path = pending.pop(0)
        if path in found:
            continue
        found[path] = None
        pending += [_HERE / name for name in _INCLUDE.findall(path.read_text())]
    return (*sources, *sorted(set(found) - set(sources)))


# Every file each build includes (the entry points' header, cpu_kernels.h, is in both).
KERNEL_FILES = local_files(SOURCES)
OPS_FILES = local_files((OPS_SOURCE,))
# -fno-trapping-math: loops with a select or a min/max around fast_exp (greedy's sum, the
# generic SwiGLU) vectorize without AVX-512's masked stores (avx2 greedy: 1.5 -> 0.43 ms at
# 32 x 49152); no FP exception flag is ever read here.
# -ffp-contract=off: a multiply and an add fuse into one FMA only where the source says so
# (the intrinsics, fast_exp.h's mul_add), never where the compiler chooses to in each place
# it inlines a helper: two AVX2 int8 attention kernels sharing softmax_heads8 gave one row
# bits an ulp apart for that alone, where batch invariance needs them equal.
BASE_FLAGS = (
    "-O3",
    "-fno-trapping-math",
    "-ffp-contract=off",
    "-fopenmp",
    "-shared",
    "-fPIC",
    "-std=c++17",
)
# torch's headers need C++20 (this torch); -O2: the shim only checks and forwards.
OPS_FLAGS = ("-O2", "-shared", "-fPIC", "-std=c++20", "-Wall")
OPS_LIBS = ("-lc10", "-ltorch_cpu")  # after the source: linkers drop unneeded libraries


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


def _torch_dir(name: str) -> Path:
    import torch

    path = Path(torch.__file__).parent / name
    if not path.is_dir():
        raise KernelBuildError(f"torch's C++ headers and libraries are not installed (no {path})")
    return path


def ops_flags() -> tuple[str, ...]:
    """The shim's compile and link flags: torch's headers, its ABI, its libraries (found at
    run time where they are now; they are loaded already whenever the shim is)."""
    import torch

    include, lib = _torch_dir("include"), _torch_dir("lib")
    return (
        *OPS_FLAGS,
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        f"-I{include}",
        f"-L{lib}",
        f"-Wl,-rpath,{lib}",
    )


def _key(files: Sequence[Path], flags: Sequence[str], *extra: str) -> str:
    cxx = _compiler()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256()
    for part in (*(f.read_bytes() for f in files), " ".join(flags).encode(), version.encode()):
        key.update(part)
    for part in (platform.machine(), *extra):
        key.update(part.encode())
    return key.hexdigest()[:16]


def library_path(isa: str) -> Path:
    """Where the build of the kernels for `isa`, by this compiler, lives."""
    return cache_dir() / f"cpu_kernels-{isa}-{_key(KERNEL_FILES, flags(isa))}.so"


def ops_path() -> Path:
    """Where the build of the shim, by this compiler against this torch, lives."""
    import torch

    version = f"{torch.__version__} {torch.version.git_version}"
    return cache_dir() / f"cpu_ops-{_key(OPS_FILES, ops_flags(), version)}.so"


def _compile(
    what: str,
    target: Path,
    flags: Sequence[str],
    sources: Sequence[Path],
    libs: Sequence[str] = (),
) -> Path:
    """Compiles `sources` into `target` unless it exists; atomic (a temp file renamed into
    place), so concurrent shards never load a half-written library."""
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [_compiler(), *flags, "-o", tmp, *map(str, sources), *libs],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise KernelBuildError(f"compiling {what} failed:\n{done.stderr[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def build(isa: str) -> Path:
    """The kernels for `isa`, compiled unless this exact build exists."""
    names = " and ".join(source.name for source in SOURCES)
    return _compile(f"{names} for {isa}", library_path(isa), flags(isa), SOURCES)


def build_operators() -> Path:
    """The operator shim, compiled unless this exact build exists."""
    return _compile(OPS_SOURCE.name, ops_path(), ops_flags(), (OPS_SOURCE,), OPS_LIBS)
