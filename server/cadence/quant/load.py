"""Quantized weights into a model's layers: from a `QuantizedSource` (a pre-quantized
checkpoint) or by quantizing the float weights just loaded (`--quantize`).

A source's linears come whole, in Hugging Face's names and layout; each goes through the
model's name mapping (`weight_targets`/`packed_targets`, as the float loader's) to its
layer, which takes the slice its `part` names -- exactly the rows and columns the float
loaders read, so tensor parallelism splits a quantized weight as it splits a float one.
Fused layers (q/k/v, gate/up) gather their pieces until every row is there, then build
one `QuantizedProduct`.

Each quantized layer either keeps a float weight (the dequantized values, prepacked
later like any float weight) for products of more rows than its crossover, or drops it
and serves every product quantized. A tied LM head always keeps its float weight: it is
the embedding table.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from cadence.layers.embedding import ParallelLMHead
from cadence.layers.linear import LinearBase
from cadence.models.loader import TensorSlice, WeightFiller
from cadence.quant.checkpoints import QuantizedSource
from cadence.quant.crossover import ALL_ROWS, format_of
from cadence.quant.formats import Int4Weight, Int8BlockWeight, Int8Weight, QuantizedWeight
from cadence.quant.product import ProductKernels, QuantizedProduct, describe
from cadence.quant.quantize import group_size_for, quantize_int4, quantize_int8


@dataclass(frozen=True, slots=True)
class Dispatch:
    """How quantized layers share the products with a float weight."""

    keep_float: bool  # keep a float weight for products above the crossover
    products: ProductKernels  # the shard's product kernels
    crossover: dict[str, int] = field(default_factory=dict)  # "int8"/"int4" -> most rows
    # keep it even where the quantized kernel serves every row count (asked for: "on")
    keep_float_always: bool = False

    def keeps_float(self, formats: Iterable[str]) -> bool:
        """Whether a layer of `formats` keeps its float weight: only where some product
        would read it, unless asked to always."""
        if not self.keep_float:
            return False
        return self.keep_float_always or self.rows_for(formats) < ALL_ROWS

    def rows_for(self, formats: Iterable[str]) -> int:
        return min(self.crossover.get(format_of(f), 0) for f in formats)


def quantizable(module: nn.Module) -> bool:
    return isinstance(module, LinearBase | ParallelLMHead)


def _pad_rows(weight: QuantizedWeight, rows: int) -> QuantizedWeight:
    """`weight` with zero rows appended up to `rows` (a padded vocabulary shard)."""
    pad = rows - weight.shape[0]
    if pad <= 0:
        return weight
    cols = weight.shape[1]
    if isinstance(weight, Int8Weight):
        q = torch.cat([weight.q, weight.q.new_zeros(pad, cols)])
        return Int8Weight(q, torch.cat([weight.scale, weight.scale.new_zeros(pad)]))
    if isinstance(weight, Int8BlockWeight):
        q = torch.cat([weight.q, weight.q.new_zeros(pad, cols)])
        zeros = weight.scale.new_zeros(pad, weight.scale.shape[1])
        return Int8BlockWeight(q, torch.cat([weight.scale, zeros]))
    groups = weight.scale.shape[1]
    return Int4Weight(
        torch.cat([weight.q, weight.q.new_full((pad, cols), 8)]),  # (8 - 8) * 0 + 0 = 0
        torch.cat([weight.scale, weight.scale.new_zeros(pad, groups)]),
        torch.cat([weight.zero, weight.zero.new_zeros(pad, groups)]),
        weight.group_size,
        weight.perm,
    )


def _rank_piece(module: nn.Module, weight: QuantizedWeight, shard_id: Any) -> tuple[int, Any]:
    """(first row of the layer it fills, this rank's piece of a whole checkpoint weight)."""
    if isinstance(module, ParallelLMHead):
        stop = min(module.start + module.shard_size, module.vocab_size)
        return 0, _pad_rows(weight.rows(module.start, stop - module.start), module.shard_size)
    part = module.part(shard_id)
    if part.rows is not None:
        weight = weight.rows(*part.rows)
    if part.cols is not None:
        weight = weight.cols(*part.cols)
    return part.offset, weight


def install(
    module: nn.Module,
    pieces: list[QuantizedWeight],
    dispatch: Dispatch,
    float_loaded: bool,
    shared: bool,
) -> None:
    """Gives `module` its quantized product over `pieces` (its rows in order), and keeps,
    fills or drops its float weight. `float_loaded`: the float weight already holds the
    values (quantized at load, or a tied head's embedding); `shared`: another module
    uses the same weight (a tied head's embedding), which therefore stays."""
    weight: nn.Parameter = module.weight
    formats = [describe(p) for p in pieces]
    keep = dispatch.keeps_float(formats) or shared
    module.quantized = QuantizedProduct(
        pieces, weight.dtype, weight.device, dispatch.rows_for(formats), keep, dispatch.products
    )
    if keep and not float_loaded:
        with torch.no_grad():
            weight.copy_(torch.cat([p.dequantize(weight.dtype) for p in pieces]))
    elif not keep:  # every product is quantized: no float weight to hold
        empty = torch.empty(0, weight.shape[1], dtype=weight.dtype, device=weight.device)
        module.weight = nn.Parameter(empty, requires_grad=False)
        module.packed_weight = None


def shared_weights(model: nn.Module) -> set[int]:
    """Ids of the parameters held under more than one name (tied embeddings)."""
    seen: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    return {i for i, n in seen.items() if n > 1}


def load_from_source(model: nn.Module, source: QuantizedSource, dispatch: Dispatch) -> int:
    """Fills `model` from `source`: float tensors through the float loaders, quantized
    linears sliced for this rank into their layers. Returns the number of layers that
    got a quantized weight; raises if any parameter is left unfilled."""
    filler = WeightFiller(model)
    for name, tensor in source.float_tensors():
        filler.put(name, TensorSlice(tensor))
    modules = dict(model.named_modules())
    shared = shared_weights(model)
    staged: dict[str, list[tuple[int, QuantizedWeight]]] = {}
    for name, whole in source.quantized_linears():
        for target in filler.targets(name):
            owner = target.param.removesuffix(".weight")
            module = modules.get(owner)
            if module is None or not quantizable(module):
                raise KeyError(f"quantized tensor {name!r} has no quantizable layer in the model")
            weight = whole.rows(*target.rows) if target.rows is not None else whole
            staged.setdefault(owner, []).append(_rank_piece(module, weight, target.shard_id))
    for owner, placed in staged.items():
        module = modules[owner]
        placed.sort(key=lambda item: item[0])
        _check_rows(owner, module, placed)
        float_loaded = id(module.weight) in filler.loaded
        pieces = [piece for _, piece in placed]
        install(module, pieces, dispatch, float_loaded, id(module.weight) in shared)
        filler.loaded.add(id(module.weight))
    filler.check_complete()
    blocks = getattr(source, "embedding_int8_blocks", None)
    if blocks is not None:
        serve_tied_head_in_blocks(model, blocks, dispatch)
    return len(staged)


def serve_tied_head_in_blocks(
    model: nn.Module, table: Callable[[], Int8BlockWeight | None], dispatch: Dispatch
) -> None:
    """A tied LM head whose table the file stores in int8 blocks of 32 (`table()`: GGUF's
    Q8_0 bytes, which llama.cpp multiplies by): where the integer product serves, it
    multiplies by those blocks (this rank's vocabulary rows); the embedding keeps its float
    table for lookups. Elsewhere the head stays float."""
    shared = shared_weights(model)
    heads = [
        m
        for m in model.modules()
        if isinstance(m, ParallelLMHead)
        and getattr(m, "quantized", None) is None
        and id(m.weight) in shared
        and dispatch.products is ProductKernels.CPU_INTEGER
    ]
    whole = table() if heads else None
    for module in heads if whole is not None else []:
        _, piece = _rank_piece(module, whole, None)
        install(module, [piece], dispatch, True, True)


def _check_rows(owner: str, module: nn.Module, placed: list[tuple[int, QuantizedWeight]]) -> None:
    """The pieces cover the layer's rows exactly once, in its input width."""
    expected_rows, expected_cols = module.weight.shape
    row = 0
    for offset, piece in placed:
        if offset != row or piece.shape[1] != expected_cols:
            raise ValueError(
                f"{owner}: quantized pieces do not tile its [{expected_rows}, {expected_cols}] "
                "weight (a fused layer mixing float and quantized parts is not supported)"
            )
        row += piece.shape[0]
    if row != expected_rows:
        raise ValueError(f"{owner}: quantized rows cover {row} of {expected_rows}")


# The LM head is quantized to int8 under either format: on SmolLM2-135M, int8 costs
# +0.10% perplexity on the bench corpus where int4 costs +3.8% (the other linears in int4
# g32: +0.00%; benchmarks/kernels/quant_accuracy.py), and a head in int8 is still a decode win.
LM_HEAD_FORMAT = "int8"


def quantize_model(model: nn.Module, fmt: str, group_size: int, dispatch: Dispatch) -> int:
    """Quantizes every loaded linear (this rank's slice) to `fmt` ("int8", or "int4" in
    groups of `group_size`, smaller where a layer's input does not divide), the LM head
    to `LM_HEAD_FORMAT`. Returns the number of layers quantized."""
    if fmt not in ("int8", "int4"):
        raise ValueError(f"unknown quantization {fmt!r} (int8 or int4)")
    count = 0
    shared = shared_weights(model)
    for module in list(model.modules()):
        if not quantizable(module):
            continue
        w = module.weight.data
        this = LM_HEAD_FORMAT if isinstance(module, ParallelLMHead) else fmt
        if this == "int8":
            piece: QuantizedWeight = quantize_int8(w)
        else:
            piece = quantize_int4(w, group_size_for(w.shape[1], group_size))
        install(module, [piece], dispatch, True, id(module.weight) in shared)
        count += 1
    return count


def summary(model: nn.Module) -> dict[str, Any]:
    """What is quantized in `model`: the formats and how many layers hold each, whether
    float weights are kept, the bytes the quantized weights take."""
    products = [m.quantized for m in model.modules() if getattr(m, "quantized", None)]
    if not products:
        return {}
    formats: dict[str, int] = {}
    for p in products:
        for f in p.formats:
            formats[f] = formats.get(f, 0) + 1
    return {
        "formats": formats,
        "float_kept": all(p.float_kept for p in products),
        "quantized_bytes": sum(p.nbytes for p in products),
    }
