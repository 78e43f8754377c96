"""The kernel library's build key covers every C++ file it is made of: each source beside
cpu_builds.py is compiled into the library or the shim, and every header is hashed by a build
that includes it, so an edited file never loads a stale library from the cache."""

from __future__ import annotations

from cadence.kernels import cpu_builds as builds


def test_every_cpp_and_header_beside_builds_is_in_a_build_key() -> None:
    here = builds.OPS_SOURCE.parent
    on_disk = {*here.glob("*.cpp"), *here.glob("*.h")}
    assert on_disk == {*builds.KERNEL_FILES, *builds.OPS_FILES}
    assert {p for p in on_disk if p.suffix == ".cpp"} == {*builds.SOURCES, builds.OPS_SOURCE}


def test_the_kernel_key_hashes_the_headers_the_sources_include() -> None:
    names = {p.name for p in builds.KERNEL_FILES}
    assert {"cache_rows.h", "fast_exp.h", "attention_avx2.h", "cpu_kernels.h"} <= names
    assert "cpu_ops_checks.h" not in names  # the shim's own checks
