"""An adapter's weights paged into the KV cache's blocks (unified paging).

The KV pool `[layers, 2, num_blocks, block_size, kv_heads, head_dim]` is read as one flat
buffer of the model's compute dtype (its bytes reinterpreted, whatever the KV storage
dtype), and for a row width w as the rows `rows_w = flat.as_strided((n - w + 1, w), (1,
1))`: row i of that view starts at element i, so a row index is an element offset and a
row may start anywhere. A matrix [r, w] of an adapter (a layer's stacked A, a piece's Bᵀ)
is stored as r rows, each wholly inside one (layer, k|v) "slab" of one of the adapter's
blocks, so that a freed block takes nothing of another adapter with it. Each slab holds
rows of one width only, `slab // w` of them, from the slab's first element.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cadence.kv_cache import KVCache
from cadence.lora.weights import AdapterWeights


class AdapterFitError(ValueError):
    """An adapter whose rows cannot be laid out in this KV pool."""


@dataclass(frozen=True, slots=True)
class PoolShape:
    """What placement needs of the KV pool: its slabs' count and size."""

    num_layers: int
    num_blocks: int
    slab_bytes: int  # one (layer, k|v) slab of one block

    @classmethod
    def of(cls, cache: KVCache) -> PoolShape:
        layers, _, blocks = cache.blocks.shape[:3]
        slab = math.prod(cache.block_shape) * cache.blocks.element_size()
        return cls(layers, blocks, slab)

    @property
    def slabs_per_block(self) -> int:
        return 2 * self.num_layers

    def slab_elements(self, dtype: torch.dtype) -> int:
        """A slab's length in elements of `dtype`."""
        if self.slab_bytes % dtype.itemsize:
            raise AdapterFitError(
                f"a KV block's slab of {self.slab_bytes} bytes is not a whole number of "
                f"{dtype} elements; choose another --block-size"
            )
        return self.slab_bytes // dtype.itemsize


def rows_per_slab(slab: int, width: int) -> int:
    """Rows of `width` elements one slab of `slab` elements holds (rows start anywhere)."""
    return slab // width


@dataclass(frozen=True, slots=True)
class Matrix:
    """One matrix of an adapter as placement sees it: `rows` of `width` elements."""

    layer: str  # the model's layer it belongs to
    what: str  # "A" or "B of outputs <offset>..<end>"
    data: torch.Tensor  # [rows, width]


def matrices(weights: AdapterWeights) -> list[Matrix]:
    """The adapter's matrices in a fixed order: per layer, its stacked A then its pieces."""
    out = []
    for name, layer in weights.layers.items():
        out.append(Matrix(name, "A", layer.a))
        for p in layer.pieces:
            end = p.out_offset + p.b_t.shape[1]
            out.append(Matrix(name, f"B of outputs {p.out_offset}..{end}", p.b_t))
    return out


def _slabs_by_width(
    mats: list[Matrix], shape: PoolShape, dtype: torch.dtype
) -> dict[int, tuple[int, int]]:
    """Width -> (rows of that width, rows one slab holds), widths in increasing order;
    refuses a row wider than a slab, naming the first matrix that has it."""
    slab = shape.slab_elements(dtype)
    need: dict[int, tuple[int, int]] = {}
    for m in mats:
        w = m.data.shape[1]
        if w not in need:
            per_slab = rows_per_slab(slab, w)
            if per_slab == 0:
                raise AdapterFitError(
                    f"{m.layer} ({m.what}): a rank row of {w} elements does not fit a KV "
                    f"block of {slab} ({dtype} elements per layer's keys or values); raise "
                    "--block-size"
                )
            need[w] = (0, per_slab)
        rows, per_slab = need[w]
        need[w] = (rows + m.data.shape[0], per_slab)
    return dict(sorted(need.items()))


def blocks_needed(weights: AdapterWeights, shape: PoolShape, dtype: torch.dtype) -> int:
    """The fewest KV blocks whose slabs hold all of the adapter's rows (each slab rows of
    one width, as many as fit in every slab)."""
    need = _slabs_by_width(matrices(weights), shape, dtype)
    slabs = sum(-(-rows // per_slab) for rows, per_slab in need.values())
    return -(-slabs // shape.slabs_per_block)


@dataclass(frozen=True, slots=True)
class PagedPiece:
    out_offset: int
    rank_start: int
    out_size: int
    b_rows: torch.Tensor  # [r] long: rows of `rows_{out_size}` holding Bᵀ


@dataclass(frozen=True, slots=True)
class PagedLayer:
    in_features: int
    a_rows: torch.Tensor  # [R] long: rows of `rows_{in_features}` holding the stacked A
    pieces: tuple[PagedPiece, ...]

    @property
    def rank(self) -> int:
        return self.a_rows.shape[0]


@dataclass(frozen=True, slots=True)
class PagedAdapter:
    """An adapter written into its blocks: where each of its matrices' rows are."""

    name: str
    blocks: tuple[int, ...]
    layers: dict[str, PagedLayer]


class PoolRows:
    """The KV pool read as rows of the compute dtype, one view per width (built once per
    cache and width)."""

    def __init__(self, cache: KVCache, dtype: torch.dtype) -> None:
        self.cache = cache
        self.dtype = dtype
        self.shape = PoolShape.of(cache)
        self.flat = cache.blocks.view(-1).view(torch.uint8).view(dtype)
        self._rows: dict[int, torch.Tensor] = {}

    def rows(self, width: int) -> torch.Tensor:
        """The pool as rows of `width` elements, row i starting at element i (rows
        overlap: read them through an index, write through `write`)."""
        view = self._rows.get(width)
        if view is None:
            n = self.flat.numel() - width + 1
            view = self._rows[width] = self.flat.as_strided((n, width), (1, 1))
        return view

    def write(self, starts: torch.Tensor, data: torch.Tensor) -> None:
        """Row i of `data` [n, w] into the pool from element `starts[i]`."""
        width = data.shape[1]
        at = starts.to(self.flat.device)[:, None] + torch.arange(width, device=self.flat.device)
        self.flat[at.flatten()] = data.to(self.flat.device, self.dtype).flatten()


def _row_indices(
    slabs: torch.Tensor, slab: int, width: int, per_slab: int, count: int
) -> torch.Tensor:
    """The first `count` row starts (element offsets) over `slabs` (flat slab indices),
    `per_slab` from each slab's first element."""
    return (slabs[:, None] * slab + torch.arange(per_slab) * width).flatten()[:count]


def page_in(weights: AdapterWeights, blocks: list[int], pool: PoolRows) -> PagedAdapter:
    """Writes the adapter's rows into `blocks` (at least `blocks_needed` of them; the
    first ones are used) with one indexed copy per row width."""
    shape, dtype = pool.shape, pool.dtype
    mats = matrices(weights)
    need = _slabs_by_width(mats, shape, dtype)
    slab = shape.slab_elements(dtype)
    have = len(blocks)
    wanted = blocks_needed(weights, shape, dtype)
    if have < wanted:
        raise AdapterFitError(f"adapter {weights.name} needs {wanted} KV blocks, given {have}")
    if blocks and (min(blocks) < 0 or max(blocks) >= shape.num_blocks):
        raise AdapterFitError(f"adapter {weights.name}: a block outside 0..{shape.num_blocks}")
    # slab (layer l, k|v) of block b is slab (2 l + kv) * num_blocks + b; blocks in order
    kinds = torch.arange(shape.slabs_per_block)
    slabs = (kinds[None, :] * shape.num_blocks + torch.tensor(blocks)[:, None]).flatten()
    rows_of: dict[int, torch.Tensor] = {}
    taken = 0
    for width, (rows, per_slab) in need.items():
        n_slabs = -(-rows // per_slab)
        rows_of[width] = _row_indices(slabs[taken : taken + n_slabs], slab, width, per_slab, rows)
        taken += n_slabs
        data = torch.cat([m.data for m in mats if m.data.shape[1] == width])
        pool.write(rows_of[width], data)
    # hand each matrix its rows, in the order they were stacked
    used = dict.fromkeys(need, 0)

    def take(n: int, width: int) -> torch.Tensor:
        start = used[width]
        used[width] = start + n
        return rows_of[width][start : start + n]

    layers = {}
    for name, layer in weights.layers.items():
        a_rows = take(layer.rank, layer.a.shape[1])
        pieces = tuple(
            PagedPiece(p.out_offset, p.rank_start, p.b_t.shape[1], take(*p.b_t.shape))
            for p in layer.pieces
        )
        layers[name] = PagedLayer(layer.a.shape[1], a_rows, pieces)
    return PagedAdapter(weights.name, tuple(blocks), layers)


def read_layer(paged: PagedLayer, pool: PoolRows) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A paged layer's A and each piece's Bᵀ read back from the pool."""
    a = pool.rows(paged.in_features)[paged.a_rows]
    return a, [pool.rows(p.out_size)[p.b_rows] for p in paged.pieces]
