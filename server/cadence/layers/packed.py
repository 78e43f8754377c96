"""Linear weights prepacked on CPU: for cadence's float32 tiles, or for oneDNN.

`F.linear` on a CPU tensor reorders (bfloat16, through oneDNN) or packs (float32,
through MKL's sgemm) the weight on every call; for a decode-sized batch (a few dozen
rows) that costs as much as the product itself. `pack_linear_weights` stores each linear
weight once more in oneDNN's blocked layout, and `linear` multiplies through it:

- bfloat16 up to 320 rows (1.4x faster than `F.linear` from 32 to 320 rows on SmolLM2's
  shapes); from ~350 rows oneDNN takes another path and the two are equal, so larger
  batches (prefill chunks) keep `F.linear`. Only where the CPU kernels run with AVX-512:
  oneDNN refuses to prepack bfloat16 on CPUs without AVX-512 BW/VL/DQ (or AVX-NE-CONVERT).
- float32 at every batch size: SmolLM2's 30 layers and LM head with oneDNN and MKL held to
  AVX2 take 1.9x less time than `F.linear` at 1 row, 1.6x at 32, 1.2x at 1024
  (`benchmarks/kernels/cpu_linear_bench.py --dtype float32`).

With the avx2 kernels, float32 weights are packed instead in panels of 16 output columns
for cadence's own product (`torch.ops.cadence.float_matmul`, float_kernels.cpp): on a
2-core Zen 3 it multiplies SmolLM2's 30 layers and LM head 2.0x faster than oneDNN's
prepacked product at 1 row, 1.3x at 32, 1.1x at 320 and as fast from 512 rows on
(docs/benchmarks.md). Each output is one FMA chain over the input columns in order, so a
row's bits do not depend on the other rows. The AVX-512 builds have the same tiles but
default to oneDNN, whose float32 product has AVX-512; on every build the kernel table
measured on the machine decides where it has measured (`cadence.quant.float_calibrate`).

On a CPU with AMX-BF16 (a Sapphire Rapids), bfloat16 weights may be packed instead as AMX's
B tiles for cadence's own product (`torch.ops.cadence.bf16_matmul_tiles`, bf16_kernels.cpp),
where the kernel table measured it faster than oneDNN's (`cadence.quant.calibrate`): each
output one tdpbf16ps chain over the inputs in order, so a row's bits do not depend on the
other rows, and batch-invariant serving need not split its products (oneDNN's, on AMX
there, give a row other bits from 33 rows on).

Batch-invariant serving (`every_row_count`) multiplies bfloat16 through the packed weight
at every row count too: oneDNN's prepacked product gives each row the same bits whatever
the number of rows (`cadence.shard.determinism` checks it at start), `F.linear` does not.

Each dtype is tried once on a tiny weight before any model weight is packed.
Off with the C++ kernels (`--no-cpu-kernels`).
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from cadence.kernels import cpu as cpu_kernels
from cadence.quant.float_calibrate import AMX_BF16, ONEDNN, TILE_ISAS, TILES

BF16_PACKED_MAX_ROWS = 320  # bf16 rows up to which the packed weight is used
EVERY_ROW_COUNT = 1 << 30
_PACK_HINT_ROWS = 32  # the batch size oneDNN chooses the blocked layout for
TILE_COLS = 16  # output columns per panel of the float32 tiles (float_kernels.cpp)
AMX_COLS, AMX_K = 16, 32  # a packed AMX-BF16 tile: 16 channels x 32 inputs
HARDWARE_TILES = 1  # bf16_matmul_tiles' tiles: the AMX instructions


@cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN prepacks and multiplies a weight of `dtype` on this CPU (tried once)."""
    if not (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    ):
        return False
    try:
        weight = torch.ones(16, 16, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_HINT_ROWS)
        x = torch.ones(2, 16, dtype=dtype)
        torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except RuntimeError:
        return False
    return True


# Where float32 products go: TILES, ONEDNN, or None for the instruction set's default
# (the tiles with the avx2 kernels, oneDNN above them) until a kernel table measured here
# says otherwise (`cadence.quant.float_calibrate`, set by the shard before it packs).
_float_product: str | None = None


def use_float_product(kind: str | None) -> None:
    """Serves float32 products by `kind` (TILES or ONEDNN; None: the default per
    instruction set). Call before the weights are packed."""
    global _float_product
    if kind not in (TILES, ONEDNN, None):
        raise ValueError(f"float product {kind!r}: expected {TILES!r} or {ONEDNN!r}")
    _float_product = kind


def float_product_choice() -> str | None:
    """What `use_float_product` set last (None: the default per instruction set)."""
    return _float_product


def default_float_product(isa: str | None) -> str:
    """TILES with the avx2 kernels (measured 1.1-2x oneDNN's prepacked product on a Zen 3),
    ONEDNN with the AVX-512 ones (whose float32 product has AVX-512)."""
    return TILES if isa == "avx2" else ONEDNN


# Where bfloat16 products go: AMX_BF16 (cadence's AMX-BF16 tiles) where a kernel table
# measured here chose them, else oneDNN (set by the shard before it packs).
_bf16_product: str | None = None


def use_bf16_product(kind: str | None) -> None:
    """Serves bfloat16 products by `kind` (AMX_BF16 or ONEDNN; None: oneDNN). Call before the
    weights are packed."""
    global _bf16_product
    if kind not in (AMX_BF16, ONEDNN, None):
        raise ValueError(f"bfloat16 product {kind!r}: expected {AMX_BF16!r} or {ONEDNN!r}")
    _bf16_product = kind


def bf16_product_choice() -> str | None:
    """What `use_bf16_product` set last (None: oneDNN)."""
    return _bf16_product


def amx_bf16_usable() -> bool:
    """Whether this process may run the AMX-BF16 product: the avx512_bf16 kernels are
    selected (the only ones with it), the CPU has AMX-BF16 and Linux granted it."""
    if not cpu_kernels.available() or cpu_kernels.selected_isa() != "avx512_bf16":
        return False
    return bool(torch.ops.cadence.amx_bf16_available())


def amx_bf16_serves() -> bool:
    """Whether bfloat16 products go through cadence's AMX-BF16 tiles."""
    return _bf16_product == AMX_BF16 and amx_bf16_usable()


def amx_bf16_packing(weight: torch.Tensor) -> torch.Tensor:
    """A bfloat16 weight [out, in] as `bf16_matmul_tiles` reads it: AMX's B tiles [n16,
    k32, 16, 32], tile (b, k) row p holding channel 16 b + c's inputs 32 k + 2p and
    32 k + 2p + 1 at elements 2c, 2c + 1 (zero past `out` and `in`)."""
    out, width = weight.shape
    n16, k32 = -(-out // AMX_COLS), -(-width // AMX_K)
    padded = F.pad(weight.to(torch.bfloat16), (0, k32 * AMX_K - width, 0, n16 * AMX_COLS - out))
    tiles = padded.view(n16, AMX_COLS, k32, AMX_K // 2, 2).permute(0, 2, 3, 1, 4)
    return tiles.reshape(n16, k32, AMX_K // 2, 2 * AMX_COLS).contiguous()


def is_amx_packing(packed: torch.Tensor) -> bool:
    """Whether a packed copy is for the AMX-BF16 tiles ([n16, k32, 16, 32])."""
    return packed.dim() == 4


def float_tiles_serve() -> bool:
    """Whether float32 products go through cadence's tiles instead of oneDNN: the selected
    kernels have them and the measured choice (or else the default) is them."""
    isa = cpu_kernels.selected_isa() if cpu_kernels.available() else None
    if isa not in TILE_ISAS:
        return False
    return (_float_product or default_float_product(isa)) == TILES


def tile_packing(weight: torch.Tensor) -> torch.Tensor:
    """A float32 weight [out, in] as `float_matmul` reads it: [ceil(out / 16), in, 16],
    element (p, i, c) = weight[16 p + c, i], zero past `out`."""
    out, width = weight.shape
    panels = -(-out // TILE_COLS)
    padded = F.pad(weight.float(), (0, 0, 0, panels * TILE_COLS - out))
    return padded.view(panels, TILE_COLS, width).transpose(1, 2).contiguous()


def is_tile_packing(packed: torch.Tensor) -> bool:
    """Whether a packed copy is for the float32 tiles ([n16, in, 16]; oneDNN's keeps the
    weight's two dimensions)."""
    return packed.dim() == 3


def onednn_packing(weight: torch.Tensor) -> torch.Tensor:
    """A weight [out, in] in oneDNN's blocked layout, as `_linear_pointwise` reads it."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.data.contiguous(), _PACK_HINT_ROWS)


def packed_copy(weight: torch.Tensor) -> torch.Tensor:
    """The packed copy of a weight `packing_supported` takes: for the float32 tiles where
    they serve, else oneDNN's."""
    if weight.dtype == torch.float32 and float_tiles_serve():
        return tile_packing(weight.data)
    if weight.dtype == torch.bfloat16 and amx_bf16_serves():
        return amx_bf16_packing(weight.data)
    return onednn_packing(weight)


def packing_supported(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu":
        return False
    if weight.dtype == torch.float32:
        return float_tiles_serve() or onednn_packs(torch.float32)
    if weight.dtype == torch.bfloat16 and amx_bf16_serves():
        return True
    return (
        weight.dtype == torch.bfloat16
        and cpu_kernels.available()
        and cpu_kernels.selected_isa() in ("avx512_bf16", "avx512")
        and onednn_packs(torch.bfloat16)
    )


# Where a module keeps what it found from its layers' packed tensors (the flat Llama step's
# one-call layer stacks): whoever replaces packed tensors drops it with `forget_packed_views`,
# so that no step reads a copy that was replaced.
PACKED_VIEWS = "_views_of_packed_weights"


def forget_packed_views(model: nn.Module) -> None:
    """Drops what `model`'s modules found from packed tensors that are being replaced."""
    for module in model.modules():
        module.__dict__.pop(PACKED_VIEWS, None)


def pack_linear_weights(
    model: nn.Module, enabled: bool = True, every_row_count: bool = False
) -> int:
    """Gives every module with a `packed_weight` slot its packed copy (when `enabled`),
    read by products of up to `packed_max_rows` rows: every row count for float32 or when
    `every_row_count`, else BF16_PACKED_MAX_ROWS; returns the bytes added. Call after the
    weights are loaded (and tied)."""
    added = 0
    if not enabled:
        return added
    for module in model.modules():
        if not hasattr(module, "packed_weight"):
            continue
        weight = module.weight
        if weight.numel() == 0 or not packing_supported(weight):  # 0: quantized, no float kept
            continue
        quantized = getattr(module, "quantized", None)
        if quantized is not None and quantized.serves_every_row_count:
            continue  # a float kept only as a tied table: no product reads it
        module.packed_weight = packed = packed_copy(weight)
        own = is_tile_packing(packed) or is_amx_packing(packed)  # cadence's own products
        every = every_row_count or weight.dtype is torch.float32 or own
        module.packed_max_rows = EVERY_ROW_COUNT if every else BF16_PACKED_MAX_ROWS
        added += packed.nbytes if own else weight.numel() * weight.element_size()
    forget_packed_views(model)  # packed again after a step: the steps find the new copies
    return added


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    packed: torch.Tensor | None,
    packed_max_rows: int | None = None,
) -> torch.Tensor:
    """F.linear, through the packed weight when there is one and `x` has at most
    `packed_max_rows` rows (None: every row count for float32, BF16_PACKED_MAX_ROWS for
    bfloat16): by cadence's float32 or AMX-BF16 tiles or oneDNN, whichever it was packed
    for (the AMX tiles at every row count)."""
    if packed is not None and is_amx_packing(packed) and x.dim() == 2:
        return torch.ops.cadence.bf16_matmul_tiles(x, packed, bias, weight.shape[0], HARDWARE_TILES)
    if packed_max_rows is None:
        every = x.dtype is torch.float32
        packed_max_rows = EVERY_ROW_COUNT if every else BF16_PACKED_MAX_ROWS
    if packed is not None and x.dim() == 2 and x.shape[0] <= packed_max_rows:
        if is_tile_packing(packed):
            return torch.ops.cadence.float_matmul(x, packed, bias, weight.shape[0])
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
    return F.linear(x, weight, bias)
