"""Whether float32 weights multiply faster on cadence's own tiles or on oneDNN's prepacked
product on this machine, measured with the kernel table (`cadence.quant.calibrate`).

The tiles (`torch.ops.cadence.float_matmul`) were 1.1-2x oneDNN on a Zen 3 with AVX2, but
what oneDNN does with AVX-512 (or on another vendor's AVX2 core) is another matter, so the
choice is measured where both can serve: the avx2, avx512 and avx512_bf16 kernels with
oneDNN able to prepack float32. Both sides are timed over the same products as the
quantized side's measurement (SmolLM2-135M's, a few layers and its LM head), at a decode
step's rows and a prefill chunk's, call by call in turn, weighted as the charter workload
mixes them. One kernel for every row count, not a crossover: the tiles give a row the same
bits whatever the other rows, and a product that switched kernels with the row count would
not. The side that is not the instruction set's default must win by MARGIN: a choice that
flipped with a shared machine's noise would change answers from one start to the next.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# torch is imported where it is used: the launcher reads the table without it.
TILES, ONEDNN = "tiles", "onednn"  # where cadence.layers.packed sends float32 products
AMX_BF16 = "amx"  # and bfloat16 ones, beside ONEDNN: cadence's AMX-BF16 tiles
TILE_ISAS = ("avx2", "avx512", "avx512_bf16")  # the kernel builds with the AVX2+FMA tiles
MARGIN = 1.05
REPEATS = 2  # timed passes per side and row count, after one to warm up


@dataclass(slots=True)
class FloatMeasured:
    """Seconds per pass over the products by rows, on each side, and the one chosen."""

    choice: str  # TILES or ONEDNN
    tiles_s: dict[int, float]
    onednn_s: dict[int, float]
    measured_at: str = ""


def can_measure(isa: str) -> bool:
    """Both sides can serve float32 here: the kernels of `isa` have the tiles, and oneDNN
    prepacks float32 on this CPU."""
    import torch

    from cadence.layers import packed as packing

    return isa in TILE_ISAS and packing.onednn_packs(torch.float32)


def choose(isa: str, tiles: float, onednn: float) -> str:
    """The faster side by a pass's weighted cost; the other than `isa`'s default only
    when it wins by MARGIN."""
    from cadence.layers import packed as packing

    if packing.default_float_product(isa) == TILES:
        return ONEDNN if onednn * MARGIN < tiles else TILES
    return TILES if tiles * MARGIN < onednn else ONEDNN


def _products(shapes: Sequence[tuple[int, int]]) -> tuple[list[Callable], list[Callable]]:
    """(tiles, oneDNN) products, one per shape, over one random weight each."""
    import torch

    from cadence.layers import packed as packing

    tiles, onednn = [], []
    for out_features, in_features in shapes:
        w = torch.randn(out_features, in_features) * 0.05
        t, o = packing.tile_packing(w), packing.onednn_packing(w)
        tiles.append(lambda x, p=t, n=out_features: torch.ops.cadence.float_matmul(x, p, None, n))
        onednn.append(lambda x, p=o: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""))
    return tiles, onednn


def time_sides(
    shapes: Sequence[tuple[int, int]], rows: Sequence[int], repeats: int = REPEATS
) -> tuple[dict[int, float], dict[int, float]]:
    """(tiles, oneDNN) seconds per pass over `shapes` at each of `rows`
    (`cadence.quant.measure.fastest_passes`: the two sides' calls in turn)."""
    import torch

    from cadence.quant.measure import fastest_passes

    sides = _products(shapes)
    widths = [in_features for _, in_features in shapes]
    tiles_s, onednn_s = {}, {}
    for r in rows:
        tiles_s[r], onednn_s[r] = fastest_passes(sides, widths, r, torch.float32, repeats)
    return tiles_s, onednn_s


def measure(
    isa: str,
    shapes: Sequence[tuple[int, int]],
    rows: Sequence[int],
    mix: Callable[[dict[int, float]], float],
) -> FloatMeasured:
    """Times both sides over `shapes` at `rows`, with the kernels of `isa` selected, and
    chooses by `mix` (a pass's cost in the workload's proportions, from the seconds by
    rows)."""
    tiles_s, onednn_s = time_sides(shapes, rows)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    return FloatMeasured(choose(isa, mix(tiles_s), mix(onednn_s)), tiles_s, onednn_s, stamp)


def only_tiles() -> FloatMeasured:
    """The entry for kernels with the tiles where oneDNN cannot prepack float32: nothing
    to time, and a table that holds it is not measured again at every launch."""
    return FloatMeasured(TILES, {}, {}, time.strftime("%Y-%m-%d %H:%M:%S"))


def split_calls(product: Callable, rows: int) -> Callable:
    """`product` as batch-invariant serving calls it: in products of at most `rows` rows,
    joined (`cadence.layers.linear`; 0: in one call)."""
    import torch

    if not rows:
        return product
    return lambda x: (
        product(x)
        if len(x) <= rows
        else torch.cat([product(x[i : i + rows]) for i in range(0, len(x), rows)])
    )


def time_bf16_sides(
    shapes: Sequence[tuple[int, int]],
    rows: Sequence[int],
    onednn_split: int,
    repeats: int = REPEATS,
) -> tuple[dict[int, float], dict[int, float]]:
    """(AMX-BF16 tiles, oneDNN) seconds per pass over bfloat16 weights of `shapes` at each of
    `rows`, the two sides' calls in turn; oneDNN's in products of at most `onednn_split`
    rows, as batch invariance serves it (0: in one call). oneDNN's side is {} where it
    cannot prepack bfloat16 (oneDNN held below AVX-512)."""
    import torch

    from cadence.layers import packed as packing
    from cadence.quant.measure import fastest_passes

    with_onednn = packing.onednn_packs(torch.bfloat16)
    amx, onednn = [], []
    for out_features, in_features in shapes:
        w = (torch.randn(out_features, in_features) * 0.05).to(torch.bfloat16)
        t = packing.amx_bf16_packing(w)
        amx.append(
            lambda x, p=t, n=out_features: torch.ops.cadence.bf16_matmul_tiles(
                x, p, None, n, packing.HARDWARE_TILES
            )
        )
        if with_onednn:
            o = packing.onednn_packing(w)
            one = lambda x, p=o: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")  # noqa: E731
            onednn.append(split_calls(one, onednn_split))
    widths = [in_features for _, in_features in shapes]
    sides = (amx, onednn) if with_onednn else (amx,)
    amx_s, onednn_s = {}, {}
    for r in rows:
        times = fastest_passes(sides, widths, r, torch.bfloat16, repeats)
        amx_s[r] = times[0]
        if with_onednn:
            onednn_s[r] = times[1]
    return amx_s, onednn_s


def measure_bf16(
    shapes: Sequence[tuple[int, int]],
    rows: Sequence[int],
    mix: Callable[[dict[int, float]], float],
    onednn_split: int,
) -> FloatMeasured:
    """AMX-BF16 tiles against oneDNN for bfloat16 weights (the avx512_bf16 kernels selected,
    AMX-BF16 usable here), oneDNN's split as batch invariance serves it: oneDNN is the
    default, the tiles serve only when they win by MARGIN."""
    amx_s, onednn_s = time_bf16_sides(shapes, rows, onednn_split)
    choice = AMX_BF16 if not onednn_s or mix(amx_s) * MARGIN < mix(onednn_s) else ONEDNN
    return FloatMeasured(choice, amx_s, onednn_s, time.strftime("%Y-%m-%d %H:%M:%S"))


def bf16_not_timed() -> FloatMeasured:
    """The bfloat16 entry where the AMX-BF16 tiles cannot serve: oneDNN, nothing timed, and
    not measured again at every launch."""
    return FloatMeasured(ONEDNN, {}, {}, time.strftime("%Y-%m-%d %H:%M:%S"))


def describe_bf16(m: FloatMeasured) -> str:
    """ "cadence's AMX-BF16 tiles (AMX 5.6 / oneDNN 7.7 ms at 32 rows, ...; measured ...)"."""
    name = {AMX_BF16: "cadence's AMX-BF16 tiles", ONEDNN: "oneDNN prepacked"}[m.choice]
    if not m.tiles_s:
        return f"{name} (AMX-BF16 tiles not usable here; {m.measured_at})"
    decode, prefill = sorted(m.tiles_s)
    if not m.onednn_s:
        return (
            f"{name} (AMX {m.tiles_s[decode] * 1e3:.1f} ms at {decode} rows, "
            f"{m.tiles_s[prefill] * 1e3:.1f} at {prefill}; oneDNN cannot prepack bfloat16 "
            f"here; measured {m.measured_at})"
        )
    return (
        f"{name} (AMX {m.tiles_s[decode] * 1e3:.1f} / oneDNN {m.onednn_s[decode] * 1e3:.1f} ms"
        f" at {decode} rows, {m.tiles_s[prefill] * 1e3:.1f} / {m.onednn_s[prefill] * 1e3:.1f}"
        f" ms at {prefill}; measured {m.measured_at})"
    )


def describe(m: FloatMeasured) -> str:
    """ "tiles (tiles 3.1 / oneDNN 5.2 ms at 32 rows, 30.2 / 31.0 ms at 320; measured
    ...)"."""
    name = {TILES: "cadence's float32 tiles", ONEDNN: "oneDNN prepacked"}
    if not m.tiles_s:
        return f"{name[m.choice]} (oneDNN cannot prepack float32 here; {m.measured_at})"
    decode, prefill = sorted(m.tiles_s)
    return (
        f"{name[m.choice]} (tiles {m.tiles_s[decode] * 1e3:.1f} / oneDNN "
        f"{m.onednn_s[decode] * 1e3:.1f} ms at {decode} rows, {m.tiles_s[prefill] * 1e3:.1f}"
        f" / {m.onednn_s[prefill] * 1e3:.1f} ms at {prefill}; measured {m.measured_at})"
    )
