"""Placement of an adapter's rows in the KV pool (`cadence.lora.pool`): every row wholly
inside one slab of the adapter's own blocks, no two rows overlapping, the fewest blocks
for the packing, the weights read back exactly through the compute dtype's view of any KV
storage dtype, and the refusal of a row wider than a slab."""

from __future__ import annotations

import pytest
import torch
from cadence.kv_cache import KVCache
from cadence.lora.pool import (
    AdapterFitError,
    PoolRows,
    PoolShape,
    blocks_needed,
    matrices,
    page_in,
    read_layer,
    rows_per_slab,
)
from cadence.lora.weights import AdapterWeights, ExpandPiece, LayerLora


def adapter(
    dtype: torch.dtype, widths: list[tuple[int, list[tuple[int, int]]]], seed: int = 0
) -> AdapterWeights:
    """Layers "layer.i" with A of width in_i and pieces (rank, out width) each."""
    g = torch.Generator().manual_seed(seed)
    layers = {}
    for i, (width_in, pieces) in enumerate(widths):
        total = sum(r for r, _ in pieces)
        a = torch.randn(total, width_in, generator=g).to(dtype)
        start, out_offset, built = 0, 0, []
        for r, out in pieces:
            built.append(ExpandPiece(out_offset, start, torch.randn(r, out, generator=g).to(dtype)))
            start += r
            out_offset += out
        layers[f"layer.{i}"] = LayerLora(a, tuple(built))
    max_rank = max(r for _, pieces in widths for r, _ in pieces)
    return AdapterWeights("t", "", layers, max_rank, ("q_proj",))


def cache(storage: str, block_size: int = 16, kv_heads: int = 2, head_dim: int = 24) -> KVCache:
    return KVCache(3, 12, block_size, kv_heads, head_dim, storage, "cpu")


# widths that are not powers of two: slabs do not start at row boundaries
WIDTHS = [(72, [(4, 72), (3, 40)]), (40, [(8, 72)]), (72, [(2, 24), (5, 24), (1, 40)])]


@pytest.mark.parametrize(
    ("compute", "storage"),
    [
        (torch.float32, "float32"),
        (torch.bfloat16, "bfloat16"),
        (torch.float32, "bfloat16"),
        (torch.bfloat16, "float32"),
        (torch.bfloat16, "int8"),
        (torch.float32, "int8"),
    ],
)
def test_rows_lie_in_the_adapters_slabs_and_read_back_exactly(compute, storage):
    kv = cache(storage)
    kv.blocks.view(torch.uint8).random_(0, 256, generator=torch.Generator().manual_seed(1))
    before = kv.blocks.view(torch.uint8).clone()
    pool = PoolRows(kv, compute)
    weights = adapter(compute, WIDTHS)
    n = blocks_needed(weights, pool.shape, compute)
    blocks = [7, 2, 10, 4][:n]
    paged = page_in(weights, blocks, pool)

    # each row's bytes: inside one slab of one of the adapter's blocks, none shared
    shape, item = pool.shape, compute.itemsize
    owned: set[int] = set()
    for name, layer in paged.layers.items():
        rows = [(layer.in_features, layer.a_rows)]
        rows += [(p.out_size, p.b_rows) for p in layer.pieces]
        for width, indices in rows:
            for i in indices.tolist():
                first, last = i * item, (i + width) * item - 1  # row i starts at element i
                slab = first // shape.slab_bytes
                assert last // shape.slab_bytes == slab, f"{name}: row {i} crosses a slab"
                assert slab % shape.num_blocks in blocks, f"{name}: row {i} outside its blocks"
                span = set(range(first, last + 1))
                assert not span & owned, f"{name}: row {i} overlaps another"
                owned |= span
    # the weights read back bit for bit; every byte outside the rows is as it was
    for name, layer in weights.layers.items():
        a, bs = read_layer(paged.layers[name], pool)
        assert torch.equal(a, layer.a)
        for b, piece in zip(bs, layer.pieces, strict=True):
            assert torch.equal(b, piece.b_t)
    after = kv.blocks.view(torch.uint8).flatten()
    untouched = torch.ones(after.numel(), dtype=torch.bool)
    untouched[torch.tensor(sorted(owned))] = False
    assert torch.equal(after[untouched], before.flatten()[untouched])


@pytest.mark.parametrize("storage", ["float32", "bfloat16", "int8"])
def test_blocks_needed_is_the_fewest_for_the_packing(storage):
    """One width per slab, as many rows as fit in every slab: the count is the fewest
    blocks whose slabs hold each width's rows, and page_in refuses one block less."""
    kv = cache(storage)
    pool = PoolRows(kv, torch.float32)
    weights = adapter(torch.float32, WIDTHS)
    slab = pool.shape.slab_elements(torch.float32)
    rows: dict[int, int] = {}
    for m in matrices(weights):
        rows[m.data.shape[1]] = rows.get(m.data.shape[1], 0) + m.data.shape[0]
    slabs = sum(-(-n // rows_per_slab(slab, w)) for w, n in rows.items())
    n = blocks_needed(weights, pool.shape, torch.float32)
    assert n == -(-slabs // pool.shape.slabs_per_block)
    assert (n - 1) * pool.shape.slabs_per_block < slabs
    with pytest.raises(AdapterFitError, match=f"needs {n} KV blocks, given {n - 1}"):
        page_in(weights, list(range(n - 1)), pool)


def test_a_row_fits_every_slab_position_that_holds_it():
    """Rows start at any element: a slab of 1,024 holds one 576-wide row wherever it
    starts (SmolLM2's one-KV-head rank over 2 shards, 16-token blocks), where rows at
    multiples of their width would not fit every slab."""
    assert rows_per_slab(1024, 576) == 1
    kv = cache("float32", block_size=16, kv_heads=1, head_dim=64)
    pool = PoolRows(kv, torch.float32)
    weights = adapter(torch.float32, [(576, [(8, 576), (8, 64)])])
    n = blocks_needed(weights, pool.shape, torch.float32)
    assert n == 5  # 16 + 8 slabs of one 576-wide row, 1 of sixteen 64-wide rows: 25 of 6
    for blocks in (list(range(n)), list(range(11, 11 - n, -1))):
        paged = page_in(weights, blocks, pool)
        for name, layer in weights.layers.items():
            a, bs = read_layer(paged.layers[name], pool)
            assert torch.equal(a, layer.a)
            for b, piece in zip(bs, layer.pieces, strict=True):
                assert torch.equal(b, piece.b_t)


def test_a_row_wider_than_a_slab_is_refused_naming_the_layer():
    shape = PoolShape.of(cache("float32", block_size=1, kv_heads=1, head_dim=32))
    weights = adapter(torch.float32, [(32, [(2, 32)]), (64, [(2, 32)])])
    with pytest.raises(AdapterFitError, match=r"layer\.1 \(A\): a rank row of 64 elements does "):
        blocks_needed(weights, shape, torch.float32)
    with pytest.raises(AdapterFitError, match="raise --block-size"):
        blocks_needed(weights, shape, torch.float32)
