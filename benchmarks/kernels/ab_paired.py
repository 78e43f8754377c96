"""A change to the C++ kernel sources measured against a commit's version of the same files,
call by call in one process: both kernel libraries are built (cached per source hash, as a
launch builds them) and loaded side by side, and each call of the benchmark runs on one
and then the other (A B, then B A), so a drift of the host between calls weighs on both
alike. On a shared 2-core guest, whose speed moves by a third within minutes,
`ab_source.sh`'s alternation of whole processes could not tell 2% apart; the median of
the per-pair ratios here can. Before timing, one call on each side is compared bit for
bit, so a change meant to move no bit is shown to move none (or how far it moves them).

    PYTHONPATH=server python benchmarks/kernels/ab_paired.py REV FILE... --bench NAME
        [--threads 2] [--pairs 300] [--a-base-flags "FLAG..."]

FILE: kernel sources under server/cadence/kernels/cpu (not the operator shim cpu_ops.cpp,
of which a process loads one). The working tree's files are put back however the build
of REV's ends. --a-base-flags: side A compiled with these in place of cpu_builds.py's
BASE_FLAGS (a change of the build's flags, measured as a change of its sources is).
Benchmarks (SmolLM2-135M's shapes: 9 query heads over 3 KV heads of 64):

- decode: one layer's decode attention, 32 sequences of 380-460 tokens, float32 queries
  over a bfloat16 cache, each sequence its own blocks;
- decode-layers: the same over 30 layers, each with its own cache (280 MB: the blocks
  stream from memory, as in a real step, instead of sitting in the last-level cache);
- decode-layers-int8, prefill-int8: those over an int8 cache (its rows' scales drawn at
  random), float32 queries;
- prefill: one layer's batch-invariant prompt attention, 3 prompts of 320 tokens, each
  token a query over the prompt up to itself;
- int4, int8: a 32-row product by a gate/up weight (3072 x 576) in that format;
- greedy: greedy sampling with log-probabilities over 32 rows of 49,152 logits.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from cadence.kernels import cpu_builds
from cadence.kernels.cpu import ops, selection

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "server/cadence/kernels/cpu"
WARM_PAIRS = 5  # pairs run before any is counted (pages, caches)


@contextlib.contextmanager
def base_flags(flags: Sequence[str] | None) -> Iterator[None]:
    """Builds inside compile with `flags` as cpu_builds.BASE_FLAGS (None: as they are),
    which are put back however the block ends."""
    saved = cpu_builds.BASE_FLAGS
    if flags is not None:
        cpu_builds.BASE_FLAGS = tuple(flags)
    try:
        yield
    finally:
        cpu_builds.BASE_FLAGS = saved


def build_at(rev: str, files: list[Path], isa: str, flags: Sequence[str] | None = None) -> Path:
    """The library of `isa` with REV's version of `files` (built unless cached), compiled
    with `flags` as the base flags if given; the working tree's files and the flags are
    restored before this returns or raises."""
    saved = {f: f.read_bytes() for f in files}
    try:
        for f in files:
            shown = subprocess.run(
                ["git", "show", f"{rev}:{f.relative_to(ROOT)}"],
                cwd=ROOT, check=True, capture_output=True,
            )  # fmt: skip
            f.write_bytes(shown.stdout)
        with base_flags(flags):
            return selection.library(isa)
    finally:
        for f, text in saved.items():
            f.write_bytes(text)


def decode_bench(prefill: bool, layers: int = 1, int8: bool = False) -> Callable[[], object]:
    g = torch.Generator().manual_seed(0)
    kv_heads, heads, head_dim, block, per_seq = 3, 9, 64, 16, 30
    if prefill:  # 3 prompts x 320 tokens, token i attending over tokens 0..i of its prompt
        tokens = 320
        tables = torch.randperm(3 * per_seq, generator=g).view(3, per_seq)
        tables = tables.repeat_interleave(tokens, 0)
        lens = torch.arange(1, tokens + 1).repeat(3)
    else:
        tables = torch.randperm(32 * per_seq, generator=g).view(32, per_seq)
        lens = torch.randint(380, 461, (32,), generator=g)
    blocks = int(tables.max()) + 1
    shape = (blocks, block, kv_heads, head_dim)
    if int8:  # codes and each row's scale, as the cache stores them
        caches = [
            [torch.randint(-127, 128, shape, generator=g, dtype=torch.int8) for _ in "kv"]
            for _ in range(layers)
        ]
        scales = [torch.rand(shape[:3], generator=g) * 0.04 + 0.01 for _ in "kv"]
    else:
        caches = [[torch.randn(shape, generator=g).bfloat16() for _ in "kv"] for _ in range(layers)]
        scales = [None, None]
    q = torch.randn(len(lens), heads, head_dim, generator=g)
    outs = torch.empty(layers, *q.shape)
    attend = torch.ops.cadence.paged_decode_attention.out

    def call() -> torch.Tensor:
        for (k, v), out in zip(caches, outs, strict=True):
            attend(q, k, v, tables, lens, head_dim**-0.5, None, out, *scales)
        return outs

    return call


def product_bench(fmt: str) -> Callable[[], object]:
    from cadence.quant import cpu_gemm
    from cadence.quant.quantize import quantize_int4, quantize_int8_blocks

    g = torch.Generator().manual_seed(0)
    w = torch.randn(3072, 576, generator=g) * 0.05
    weight = quantize_int4(w, 32) if fmt == "int4" else quantize_int8_blocks(w)
    kernel = cpu_gemm.IntegerCpuKernel(weight)
    x = torch.randn(32, 576, generator=g)
    return lambda: kernel(x)


def greedy_bench() -> Callable[[], object]:
    logits = torch.randn(32, 49152, generator=torch.Generator().manual_seed(0)) * 3
    return lambda: torch.ops.cadence.greedy_logprobs(logits)


BENCHES: dict[str, Callable[[], Callable[[], object]]] = {
    "decode": lambda: decode_bench(prefill=False),
    "decode-layers": lambda: decode_bench(prefill=False, layers=30),
    "prefill": lambda: decode_bench(prefill=True),
    "decode-layers-int8": lambda: decode_bench(prefill=False, layers=30, int8=True),
    "prefill-int8": lambda: decode_bench(prefill=True, int8=True),
    "int4": lambda: product_bench("int4"),
    "int8": lambda: product_bench("int8"),
    "greedy": greedy_bench,
}


def tensors_of(result: object) -> list[torch.Tensor]:
    """A call's outputs as a flat list of copies (a tensor, or a tuple of them)."""
    items = result if isinstance(result, tuple | list) else (result,)
    return [t.clone() for t in items if isinstance(t, torch.Tensor)]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte for byte (torch.equal holds -0.0 equal to 0.0, and a NaN unequal to itself)."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def compare_outputs(libraries: dict[str, Path], isa: str, call: Callable[[], object]) -> str:
    """Whether both sides give the same bits for the benchmark's inputs, or how far apart
    their outputs are: a change meant to move no bit is checked here, not only timed."""
    outputs = {}
    for side in ("A", "B"):
        ops.use(isa, libraries[side])
        outputs[side] = tensors_of(call())
    pairs = list(zip(outputs["A"], outputs["B"], strict=True))
    assert pairs, "the benchmark's call returns no tensor to compare"
    if all(same_bits(a, b) for a, b in pairs):
        return "the same bits"
    worst = max(
        float((b.double() - a.double()).abs().max()) for a, b in pairs if not same_bits(a, b)
    )
    return f"different bits, max |B - A| {worst:.3g}"


def paired_times(libraries: dict[str, Path], isa: str, call: Callable[[], object], pairs: int):
    """Seconds of each side's calls, A then B on even pairs and B then A on odd ones."""
    times: dict[str, list[float]] = {side: [] for side in libraries}
    for i in range(WARM_PAIRS + pairs):
        for side in ("A", "B") if i % 2 == 0 else ("B", "A"):
            ops.use(isa, libraries[side])
            started = time.perf_counter()
            call()
            if i >= WARM_PAIRS:
                times[side].append(time.perf_counter() - started)
    return times["A"], times["B"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("rev", help="the commit whose version of FILE... is side A")
    p.add_argument("files", nargs="+", type=Path, help="kernel sources (B: the working tree's)")
    p.add_argument("--bench", choices=sorted(BENCHES), required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--pairs", type=int, default=300)
    p.add_argument(
        "--a-base-flags",
        help="side A's compiler flags in place of cpu_builds.BASE_FLAGS, space-separated",
    )
    a = p.parse_args(argv)
    files = [f.resolve() for f in a.files]
    for f in files:
        if f.parent != KERNELS or f.name == "cpu_ops.cpp":
            p.error(f"{f}: not a kernel library source under {KERNELS} (cpu_ops.cpp excluded)")
    if a.pairs < 2:
        p.error("--pairs must be at least 2")
    isa = selection.select()  # this CPU's (or $CADENCE_CPU_ISA's) kernels
    a_flags = a.a_base_flags.split() if a.a_base_flags is not None else None
    libraries = {"A": build_at(a.rev, files, isa, a_flags), "B": selection.library(isa)}
    torch.set_num_threads(a.threads)
    call = BENCHES[a.bench]()
    outputs = compare_outputs(libraries, isa, call)
    times_a, times_b = paired_times(libraries, isa, call, a.pairs)
    ratios = sorted(b / x for x, b in zip(times_a, times_b, strict=True))
    quartile = len(ratios) // 4
    print(f"{a.bench}, {isa} kernels, {a.threads} threads, {a.pairs} pairs")
    if a_flags is not None:
        print(f"  A's base flags: {' '.join(a_flags)}; B's: {' '.join(cpu_builds.BASE_FLAGS)}")
    for side, t in (("A", times_a), ("B", times_b)):
        print(
            f"  {side} ({a.rev if side == 'A' else 'working tree'}): fastest "
            f"{min(t) * 1e3:.3f} ms, median {statistics.median(t) * 1e3:.3f} ms"
        )
    print(
        f"  B / A per pair: median {statistics.median(ratios):.3f} "
        f"(quartiles {ratios[quartile]:.3f}-{ratios[-quartile - 1]:.3f})"
    )
    print(f"  outputs: {outputs}")


if __name__ == "__main__":
    main()
