"""Random LoRA adapters built straight as `AdapterWeights` for a loaded model (this rank's
slices of one whole adapter, the same on every rank for a seed), and the same adapters
merged into a model's weights: the reference a paged adapter must reproduce.

Kept free of transformers imports: the tensor-parallel ranks import it."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import torch
from cadence.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVLinear,
    RowParallelLinear,
)
from cadence.layers.packed import pack_linear_weights
from cadence.lora.weights import AdapterWeights, ExpandPiece, LayerLora
from torch import nn

# (layer name, part of a fused layer or None) -> the rank of its LoRA there, 0: none
RankOf = Callable[[str, Any], int]
FULL_ROWS = 1024  # a whole B is drawn with this many rows, more than a tiny model's part


def parts_of(layer: LinearBase) -> list[Any]:
    """The checkpoint projections a layer fuses (their `shard_id`s), [None] when one."""
    if isinstance(layer, QKVLinear):
        return ["q", "k", "v"]
    if isinstance(layer, MergedColumnParallelLinear):
        return list(range(len(layer.output_sizes)))
    return [None]


def _draw(shape: tuple[int, ...], *key: object) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))
    return torch.randn(shape, generator=g, dtype=torch.float64) * 0.25


def random_adapter(
    model: nn.Module, name: str, rank_of: RankOf, dtype: torch.dtype, seed: int = 0
) -> AdapterWeights:
    """An adapter on every part where `rank_of` is > 0: per part a whole A [r, in] and B
    [out, r] drawn from (name, layer, part, seed), sliced to this rank's layer as the
    layer slices its weight (column-parallel: B's rows; row-parallel: A's columns)."""
    layers = {}
    max_rank = 0
    targets = set()
    for layer_name, module in model.named_modules():
        if not isinstance(module, LinearBase):
            continue
        a_parts, pieces, start = [], [], 0
        for part_id in parts_of(module):
            r = rank_of(layer_name, part_id)
            if r == 0:
                continue
            part = module.part(part_id)
            key = (name, layer_name, part_id, seed)
            if isinstance(module, RowParallelLinear):
                a = _draw((r, module.input_features_total), *key, "A")
                a = a[:, module.input_start : module.input_start + module.in_features]
                b = _draw((module.out_features, r), *key, "B")
            else:
                a = _draw((r, module.in_features), *key, "A")
                first, count = part.rows or (0, module.out_features)
                assert first + count <= FULL_ROWS  # the whole B's rows: the same on every rank
                b = _draw((FULL_ROWS, r), *key, "B")[first : first + count]
            a_parts.append(a)
            pieces.append(ExpandPiece(part.offset, start, b.T.contiguous().to(dtype)))
            start += r
            max_rank = max(max_rank, r)
            targets.add(f"{layer_name.rsplit('.', 1)[-1]}:{part_id}")
        if a_parts:
            layers[layer_name] = LayerLora(torch.cat(a_parts).to(dtype), tuple(pieces))
    return AdapterWeights(name, f"random:{name}", layers, max_rank, tuple(sorted(targets)))


def merge_into(model: nn.Module, weights: AdapterWeights, repack: bool) -> None:
    """Adds the adapter's delta Bᵀᵀ·A to the model's weights (in float64, rounded once),
    and prepacks them again when `repack`. The flat step's one-call layers, found at the
    engine's first steps from the old packed copies, are found again (pack_linear_weights
    drops them)."""
    modules = dict(model.named_modules())
    for layer_name, lora in weights.layers.items():
        w = modules[layer_name].weight
        merged = w.data.double()
        for p in lora.pieces:
            r, out = p.b_t.shape
            a = lora.a[p.rank_start : p.rank_start + r].double()
            merged[p.out_offset : p.out_offset + out] += p.b_t.double().T @ a
        w.data.copy_(merged.to(w.dtype))
    pack_linear_weights(model, enabled=repack)


def ranks_by_part(ranks: dict[str, int]) -> RankOf:
    """`rank_of` from {checkpoint-ish part name: rank}: "q"/"k"/"v" for QKV parts, "0"/"1"
    for a merged layer's, else the layer's last name component (o_proj, down_proj, fc1)."""

    def rank_of(layer_name: str, part_id: Any) -> int:
        key = str(part_id) if part_id is not None else layer_name.rsplit(".", 1)[-1]
        return ranks.get(key, 0)

    return rank_of
