"""benchmarks/kernels/ab_paired.py: the files it may swap, the working tree put back
whether REV's version builds or not, the two sides' outputs compared bit for bit, and a
whole run through its printed ratio."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "kernels" / "ab_paired.py"
KERNELS = ROOT / "server" / "cadence" / "kernels" / "cpu"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env=os.environ | {"PYTHONPATH": str(ROOT / "server")},
    )  # fmt: skip


def unchanged_source() -> Path:
    """A kernel source the working tree has as HEAD has it: REV's library is then this
    tree's, which the suite has built already."""
    for f in sorted(KERNELS.glob("*.h")):
        diff = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", str(f)], cwd=ROOT)
        if diff.returncode == 0:
            return f
    raise AssertionError("every kernel header differs from HEAD")


@pytest.mark.parametrize(
    "source", ["server/cadence/kernels/cpu/cpu_ops.cpp", "server/cadence/shard/step.py"]
)
def test_only_kernel_library_sources_are_taken(
    source: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # in this process, which has torch loaded already (a subprocess spends 4 s importing it)
    with pytest.raises(SystemExit) as exited:
        script().main(["HEAD", str(ROOT / source), "--bench", "greedy"])
    assert exited.value.code == 2
    assert "not a kernel library source" in capsys.readouterr().err


def script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ab_paired", SCRIPT)
    assert spec is not None and spec.loader is not None
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    return ab


def test_the_working_tree_is_put_back_when_revs_version_cannot_be_had() -> None:
    ab = script()
    source = unchanged_source()
    before = source.read_bytes()
    with pytest.raises(subprocess.CalledProcessError):
        ab.build_at("no-such-revision", [source], "avx2")  # git show fails
    assert source.read_bytes() == before


def test_side_a_builds_with_other_flags_which_are_put_back() -> None:
    from cadence.kernels import cpu_builds

    ab = script()
    before, default_path = cpu_builds.BASE_FLAGS, cpu_builds.library_path("avx2")
    other = tuple(f for f in before if f != "-ffp-contract=off")
    assert other != before
    with ab.base_flags(other):
        assert cpu_builds.BASE_FLAGS == other
        assert cpu_builds.library_path("avx2") != default_path  # another build, keyed apart
    assert cpu_builds.BASE_FLAGS == before
    with pytest.raises(RuntimeError), ab.base_flags(other):
        raise RuntimeError("a build that fails")
    assert cpu_builds.BASE_FLAGS == before


def test_outputs_are_compared_bit_for_bit_and_a_difference_is_sized() -> None:
    import torch
    from cadence.kernels.cpu import selection

    ab = script()
    isa = selection.select()
    library = selection.library(isa)  # built by the suite already
    sides = {"A": library, "B": library}
    first = torch.tensor([1.0, 2.0, 3.0])
    assert ab.compare_outputs(sides, isa, lambda: (first, first.long())) == "the same bits"
    calls = iter([first, first + torch.tensor([0.0, 0.25, 0.0])])
    assert ab.compare_outputs(sides, isa, lambda: next(calls)) == (
        "different bits, max |B - A| 0.25"
    )
    signs = iter([torch.tensor([0.0, 1.0]), torch.tensor([-0.0, 1.0])])
    assert ab.compare_outputs(sides, isa, lambda: next(signs)) == "different bits, max |B - A| 0"
    nan = torch.tensor([float("nan"), 1.0])
    assert ab.compare_outputs(sides, isa, lambda: nan) == "the same bits"
    with pytest.raises(AssertionError, match="no tensor"):
        ab.compare_outputs(sides, isa, lambda: None)


def test_a_run_prints_both_sides_and_the_paired_ratio() -> None:
    source = unchanged_source()
    before = source.read_bytes()
    done = run("HEAD", str(source.relative_to(ROOT)), "--bench", "greedy", "--pairs", "4")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "A (HEAD): fastest" in done.stdout
    assert "B (working tree): fastest" in done.stdout
    ratio = float(done.stdout.split("B / A per pair: median ")[1].split()[0])
    assert 0.2 < ratio < 5.0  # the same library on both sides
    assert "outputs: the same bits" in done.stdout
    assert source.read_bytes() == before


def test_decode_layers_attends_over_each_layers_own_cache() -> None:
    """The streaming benchmark: every layer's output written, each from its own cache;
    and the int8 prompts' benchmark reads its cache through the scales."""
    from cadence.kernels import cpu

    cpu.select("auto")
    outs = script().decode_bench(prefill=False, layers=3)()
    assert outs.shape == (3, 32, 9, 64) and bool(outs.isfinite().all())
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[1], outs[2])
    (prompts,) = script().decode_bench(prefill=True, int8=True)()
    assert prompts.shape == (960, 9, 64) and bool(prompts.isfinite().all())
    assert float(prompts.abs().max()) > 0.5  # codes up to 127 at scales of 0.01-0.05
