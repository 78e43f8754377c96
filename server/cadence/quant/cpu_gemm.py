"""Quantized weights packed for cadence's integer CPU product (`quant_kernels.cpp`).

The product quantizes each row of activations to int8 in blocks of 32 columns (one float
scale per row and block) and multiplies by the int4 or int8 weight with integer dot
products (`torch.ops.cadence.quant_matmul`: VNNI's vpdpbusd, or AVX2's vpmaddubsw and
vpmaddwd). The packing puts 16 output channels side by side, four input columns per
channel in each 32-bit lane, as vpdpbusd reads them:

- int4: `packed [n16, k32, 256]` uint8, byte `j * 64 + c * 4 + i` of block `(nb, b)`
  holding channel `16 nb + c`'s q at input `32 b + 4 j + i` (low nibble) and
  `32 b + 16 + 4 j + i` (high nibble); `scales [n16, k32, 2, 16]` float32: the block's
  scale and `zero - 8 * scale` per channel (w = q * scale + zero');
- int8: `packed [n16, k32, 512]` uint8, byte `j * 64 + c * 4 + i` = q + 128 of channel
  `16 nb + c` at input `32 b + 4 j + i`; `scales [n16 * 16]` float32;
- int8 in blocks of 32 (GGUF's Q8_0): int8's bytes; `scales [n16, k32, 16]` float32.

Padding channels carry zero weights; int8's padded input columns are zero too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cadence.quant.formats import (
    INT4_OFFSET,
    Int4Weight,
    Int8BlockWeight,
    Int8Weight,
    QuantizedWeight,
)

COLS = 16  # output channels per packed block
BLOCK = 32  # input columns per block (the activations' quantization block)
INT4 = 0  # the format codes of cadence_quant_matmul
INT8 = 1
INT8_BLOCKS = 2
# Which tiles compute the integer dot products (`quant_matmul_tiles`' codes): the vector
# tiles (VNNI, AVX2), AMX's tiles, or their emulation (tests). AMX's product is the vector
# one bit for bit (`quant_amx.h`), so which serves changes speed, never an answer.
VECTOR_TILES, AMX_TILES, EMULATED_AMX_TILES = 0, 1, 2
# The format codes of each calibrated format name ("int8" measures GGUF's Q8_0 too).
FORMAT_CODES = {"int4": (INT4,), "int8": (INT8, INT8_BLOCKS)}
_tiles: dict[int, int] = {}  # format code -> tiles, where not the vector tiles


def use_tiles(fmt: str, tiles: int) -> None:
    """Every integer product of format `fmt` ("int4" or "int8") in this process from now on
    computes on `tiles`: what the kernel table measured fastest here (`cadence.quant.setup`)."""
    for code in FORMAT_CODES[fmt]:
        if tiles == VECTOR_TILES:
            _tiles.pop(code, None)
        else:
            _tiles[code] = tiles


def tiles_of(fmt: str) -> int:
    return _tiles.get(FORMAT_CODES[fmt][0], VECTOR_TILES)


def tiles_for_code(code: int) -> int:
    """The tiles products of packed format `code` (`PackedWeight.fmt`) compute on."""
    return _tiles.get(code, VECTOR_TILES)


def tiles_chosen() -> tuple[tuple[int, int], ...]:
    """Every format code's tiles that are not the vector ones, in order: what changes
    when `use_tiles` chooses anew."""
    return tuple(sorted(_tiles.items()))


@dataclass(slots=True)
class PackedWeight:
    packed: torch.Tensor  # uint8, the layout of `fmt`
    scales: torch.Tensor  # float32
    fmt: int  # INT4 or INT8
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scales.numel() * 4


def _pad_rows(t: torch.Tensor, rows: int, value: float = 0) -> torch.Tensor:
    return F.pad(t, (0, 0, 0, rows - t.shape[0]), value=value) if rows > t.shape[0] else t


def pack_int4(weight: Int4Weight) -> PackedWeight:
    """`weight` (no act-order `perm`: the caller reorders the input) in the int4 layout."""
    out, k = weight.shape
    if k % BLOCK or weight.group_size % BLOCK:
        raise ValueError(f"int4 input width {k} / group {weight.group_size}: multiples of 32 only")
    n = -(-out // COLS) * COLS
    k32 = k // BLOCK
    q = _pad_rows(weight.q.to(torch.uint8), n, INT4_OFFSET)
    # [n16, c, b, half, j, i] -> the low and high nibbles -> [n16, b, j, c, i]
    q = q.reshape(n // COLS, COLS, k32, 2, 4, 4)
    nibbles = q[:, :, :, 0] | (q[:, :, :, 1] << 4)
    packed = nibbles.permute(0, 2, 3, 1, 4).contiguous().reshape(n // COLS, k32, 256)
    repeat = weight.group_size // BLOCK
    scale = _pad_rows(weight.scale.to(torch.float32).repeat_interleave(repeat, dim=1), n)
    zero = _pad_rows(weight.zero.to(torch.float32).repeat_interleave(repeat, dim=1), n)
    zero_q = zero - INT4_OFFSET * scale  # w = q * scale + zero'
    scales = torch.stack([scale, zero_q], dim=-1)  # [n, k32, 2]
    scales = scales.reshape(n // COLS, COLS, k32, 2).permute(0, 2, 3, 1).contiguous()
    return PackedWeight(packed, scales, INT4, out, k)


def _pack_int8_bytes(q: torch.Tensor) -> torch.Tensor:
    """int8 q [out, in] as the int8 layouts' bytes [n16, k32, 512] (zero padding)."""
    out, k = q.shape
    n, k32 = -(-out // COLS) * COLS, -(-k // BLOCK)
    shifted = F.pad(q.to(torch.int16), (0, k32 * BLOCK - k, 0, n - out)) + 128
    shifted = shifted.to(torch.uint8).reshape(n // COLS, COLS, k32, 8, 4)
    return shifted.permute(0, 2, 3, 1, 4).contiguous().reshape(n // COLS, k32, 512)


def pack_int8(weight: Int8Weight) -> PackedWeight:
    out, k = weight.shape
    n = -(-out // COLS) * COLS
    scales = F.pad(weight.scale.to(torch.float32), (0, n - out)).contiguous()
    return PackedWeight(_pack_int8_bytes(weight.q), scales, INT8, out, k)


def pack_int8_blocks(weight: Int8BlockWeight) -> PackedWeight:
    out, k = weight.shape
    n = -(-out // COLS) * COLS
    scales = _pad_rows(weight.scale.to(torch.float32), n)  # [n, k32]
    scales = scales.reshape(n // COLS, COLS, k // BLOCK).permute(0, 2, 1).contiguous()
    return PackedWeight(_pack_int8_bytes(weight.q), scales, INT8_BLOCKS, out, k)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel multiplies for float32 x [m, k]: q [m, k32 * 32] (as float32) and the
    scales [m, k32], per row and block of 32 columns: d = amax / 127, q = round(x * 127 /
    amax) (ties to even)."""
    m, k = x.shape
    k32 = -(-k // BLOCK)
    blocks = F.pad(x.to(torch.float32), (0, k32 * BLOCK - k)).reshape(m, k32, BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    # a tensor divided by a tensor: torch computes `127.0 / amax` as 127 * (1 / amax),
    # rounded twice, where the kernel divides once
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inv)
    return q.reshape(m, k32 * BLOCK), (amax / 127.0).squeeze(-1)


def reference_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The kernel's result for x [m, k] and the dequantized float weight [out, k]:
    the activations quantized as the kernel does, then a float32 product."""
    q, d = quantize_activations(x)
    m, k = x.shape
    x_hat = (q.reshape(m, -1, BLOCK) * d.unsqueeze(-1)).reshape(m, -1)[:, :k]
    return x_hat @ weight.to(torch.float32).t()


def takes(weight: QuantizedWeight) -> bool:
    """Whether the integer product serves `weight`: int8 always, int4 when its input width
    and group are multiples of the 32-column blocks."""
    if isinstance(weight, Int8Weight | Int8BlockWeight):
        return True
    return weight.shape[1] % BLOCK == 0 and weight.group_size % BLOCK == 0


def integer_product_is_fast(isa: str) -> bool:
    """Whether the selected C++ kernels multiply quantized weights with vector integer dot
    products: the `avx512_bf16` build (VNNI's vpdpbusd; every CPU with AVX-512 BF16 has
    VNNI) and the `avx2` one (vpmaddubsw + vpmaddwd), which beat torch's packed kernels at
    every row count measured (docs/quantization.md). The `avx512` and `scalar` builds run
    the same arithmetic in portable C++, correct but slower than torch's kernels."""
    return isa in ("avx512_bf16", "avx2")


class IntegerCpuKernel:
    """y = x[:, perm] @ W.T through `torch.ops.cadence.quant_matmul`, x quantized to int8 per
    row and block of 32 columns inside the kernel; y in x's dtype (float32 or bfloat16)."""

    def __init__(self, weight: QuantizedWeight) -> None:
        self.perm = weight.perm if isinstance(weight, Int4Weight) else None
        if isinstance(weight, Int4Weight):
            self.weight = pack_int4(weight if weight.perm is None else _without_perm(weight))
        elif isinstance(weight, Int8BlockWeight):
            self.weight = pack_int8_blocks(weight)
        else:
            self.weight = pack_int8(weight)
        self.out_features = self.weight.out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if flat.dtype not in (torch.float32, torch.bfloat16):
            flat = flat.to(torch.float32)
        if self.perm is not None:
            flat = flat.index_select(1, self.perm)
        w = self.weight
        tiles = tiles_for_code(w.fmt)
        if tiles == VECTOR_TILES:
            y = torch.ops.cadence.quant_matmul(flat, w.packed, w.scales, w.out_features, w.fmt)
        else:
            ops = torch.ops.cadence
            y = ops.quant_matmul_tiles(flat, w.packed, w.scales, w.out_features, w.fmt, tiles)
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes


def _without_perm(weight: Int4Weight) -> Int4Weight:
    """The weight as the kernel packs it: its columns are already in `perm`'s order, which
    the caller applies to the input."""
    return Int4Weight(weight.q, weight.scale, weight.zero, weight.group_size)
