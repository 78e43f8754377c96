"""Linear layers in the vLLM shape, each parameter with its own `weight_loader`.

A loader receives the checkpoint tensor as a safetensors slice (or a plain tensor) and
reads only this rank's part of it. With one rank every layer is a plain linear layer;
column-parallel layers split the output dimension, row-parallel layers split the input
dimension and all-reduce their output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from cadence.layers.packed import linear
from cadence.layers.parallel import all_reduce_sum, balanced_split, divide, tp_rank, tp_size

if TYPE_CHECKING:
    from cadence.lora.apply import LoraHook
    from cadence.quant.product import QuantizedProduct

# A checkpoint tensor: a safetensors slice (indexable, read lazily) or a torch tensor.
Loaded = Any


@dataclass(frozen=True, slots=True)
class Part:
    """Which piece of a checkpoint weight [out, in] (or bias [out]) this rank's layer
    holds, and where in its own weight it goes. The float loaders and the quantized ones
    (`cadence.quant.load`) both slice by it."""

    offset: int  # first output row of this layer's weight the piece fills
    rows: tuple[int, int] | None  # (start, count) of the checkpoint's rows; None: all
    cols: tuple[int, int] | None = None  # (start, count) of its input columns; None: all


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != {tuple(dst.shape)}")
    dst.copy_(src)


def read_part(loaded: Loaded, part: Part, is_bias: bool) -> Loaded:
    """The piece of a checkpoint tensor `part` names, reading only it. A bias follows the
    rows (a row-parallel layer's, with all rows, is whole on every rank)."""
    if part.rows is None and (is_bias or part.cols is None):
        return loaded[:]
    r0, r1 = (0, loaded.shape[0]) if part.rows is None else (part.rows[0], sum(part.rows))
    if is_bias or part.cols is None:
        return loaded[r0:r1]
    return loaded[r0:r1, part.cols[0] : sum(part.cols)]


class LinearBase(nn.Module):
    """Holds `weight` [out, in] (and `bias` [out]) created empty, filled by the loaders.

    A quantized layer also holds `quantized` (`cadence.quant.product.QuantizedProduct`):
    the product then goes through it up to its crossover row count, through the float
    weight above it when that is kept (see `product`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.tp_rank = tp_rank()
        self.tp_size = tp_size()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)
        self.packed_weight: torch.Tensor | None = None  # see cadence.layers.packed
        self.packed_max_rows = 0  # rows up to which products read packed_weight
        # products of fewer rows are padded up to min_rows, of more split into max_rows:
        # a library kernel whose row bits change with the row count is kept to the range
        # where they do not (cadence.shard.determinism)
        self.min_rows = 1
        self.max_rows = 1 << 30
        self.quantized: QuantizedProduct | None = None
        self.lora: LoraHook | None = None  # set by the engine serving adapters

    def part(self, shard_id: Any = None) -> Part:
        """This rank's piece of the checkpoint weight (of part `shard_id` of a fused layer)."""
        raise NotImplementedError

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: Any = None) -> None:
        part = self.part(shard_id)
        src = read_part(loaded, part, is_bias=param.dim() == 1)
        what = f"{type(self).__name__}" + ("" if shard_id is None else f" part {shard_id}")
        size = param.shape[0] if part.rows is None else part.rows[1]
        _copy(param.data.narrow(0, part.offset, size), src, what)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return product(self, x, self.bias)


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight."""

    def part(self, shard_id: Any = None) -> Part:
        return Part(0, None)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, divide(out_features, tp_size()), bias)

    def part(self, shard_id: Any = None) -> Part:
        size = self.out_features
        return Part(0, (self.tp_rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul
    (gate and up of a SwiGLU MLP); `shard_id` is the index of the projection."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias)

    def part(self, shard_id: Any = None) -> Part:
        assert isinstance(shard_id, int)
        offset = divide(sum(self.output_sizes[:shard_id]), self.tp_size)
        size = divide(self.output_sizes[shard_id], self.tp_size)
        return Part(offset, (self.tp_rank * size, size))


class QKVLinear(ColumnParallelLinear):
    """Query, key and value projections fused; heads split across ranks. `shard_id` is
    "q", "k" or "v".

    Heads go to ranks whole KV group by whole KV group, so grouped-query attention stays
    correct; when the KV heads do not divide evenly the ranks get uneven groups
    (SmolLM2-135M's 3 KV heads over 2 ranks: 2 and 1, with their 6 and 3 query heads).
    With fewer KV heads than ranks, each KV head is replicated on consecutive ranks that
    share its query heads. `q_heads` is this rank's (first query head, count)."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
    ) -> None:
        size, rank = tp_size(), tp_rank()
        self.head_dim = head_dim
        group = divide(num_heads, num_kv_heads)
        if num_kv_heads >= size:
            self.kv_start, self.num_kv_heads = balanced_split(num_kv_heads, size, rank)
            self.q_heads = (self.kv_start * group, self.num_kv_heads * group)
        else:  # each KV head serves `replicas` consecutive ranks
            replicas = divide(size, num_kv_heads)
            per_rank = divide(num_heads, size)
            self.kv_start, self.num_kv_heads = rank // replicas, 1
            self.q_heads = (rank * per_rank, per_rank)
        self.num_heads = self.q_heads[1]
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        LinearBase.__init__(self, hidden_size, out, bias)

    @property
    def q_features(self) -> tuple[int, int]:
        """(start, count) of this rank's attention output features: what the output
        projection's row-parallel slice must take."""
        return self.q_heads[0] * self.head_dim, self.q_heads[1] * self.head_dim

    def part(self, shard_id: Any = None) -> Part:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        if shard_id == "q":
            return Part(0, (self.q_heads[0] * self.head_dim, q_size))
        if shard_id in ("k", "v"):
            offset = q_size if shard_id == "k" else q_size + kv_size
            return Part(offset, (self.kv_start * self.head_dim, kv_size))
        raise ValueError(f"unknown qkv shard {shard_id!r}")


class RowParallelLinear(LinearBase):
    """Input features split across ranks; outputs are summed with an all-reduce. The
    bias is added once, after the reduction."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        input_split: tuple[int, int] | None = None,
    ) -> None:
        """`input_split`: this rank's (start, count) of the input features when they are
        not split evenly (the attention output after an uneven head split)."""
        if input_split is None:
            size = divide(in_features, tp_size())
            input_split = (tp_rank() * size, size)
        self.input_start = input_split[0]
        self.input_features_total = in_features
        super().__init__(input_split[1], out_features, bias)

    def part(self, shard_id: Any = None) -> Part:
        if self.in_features == self.input_features_total:
            return Part(0, None)
        return Part(0, None, (self.input_start, self.in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = product(self, x, self.bias if self.tp_rank == 0 else None)
        if self.tp_size > 1:
            all_reduce_sum(y)
        return y


def _base_product(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T (+ bias) through the quantized weight for the row counts it serves,
    else the float weight; in products of `layer.min_rows` to `layer.max_rows` rows
    (padded, or split in order)."""
    rows = x.numel() // x.shape[-1]
    if rows > layer.max_rows:
        step = layer.max_rows
        parts = [_base_product(layer, x[i : i + step], bias) for i in range(0, rows, step)]
        return torch.cat(parts)
    if rows < layer.min_rows:
        return _base_product(layer, F.pad(x, (0, 0, 0, layer.min_rows - rows)), bias)[:rows]
    if _quantized_serves(layer, rows):
        return layer.quantized(x, bias)
    return linear(x, layer.weight, bias, layer.packed_weight, layer.packed_max_rows)


def _quantized_serves(layer: nn.Module, rows: int) -> bool:
    quantized = layer.quantized
    return quantized is not None and quantized.serves(rows)


def one_float_call(layer: nn.Module, rows: int) -> bool:
    """Whether `layer`'s product of `rows` rows is one call on its float weight (packed or
    not): within its row range, no quantized kernel serving them. What a kernel that fuses
    more into that call (`cadence.runners.llama_cpu_flat`) may replace."""
    return layer.min_rows <= rows <= layer.max_rows and not _quantized_serves(layer, rows)


def lora_delta_due(layer: nn.Module) -> Any:
    """`layer`'s LoRA hook where this step adds a delta to its product, else None."""
    hook = getattr(layer, "lora", None)
    return hook if hook is not None and hook.context.step is not None else None


def product(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`layer`'s x @ weight.T (+ bias): through its quantized weight for the row counts
    that serves (all of them when no float weight is kept), else the float weight
    (prepacked when it has a packed copy); plus the LoRA delta of the step's adapters on
    this layer when it has some (`cadence.lora.apply`; a row-parallel layer's partial
    output gets its part of it, before the all-reduce)."""
    y = _base_product(layer, x, bias)
    hook = lora_delta_due(layer)
    if hook is not None:
        hook.add_delta_(x, y)
    return y


__all__ = [
    "ColumnParallelLinear",
    "LinearBase",
    "MergedColumnParallelLinear",
    "QKVLinear",
    "ReplicatedLinear",
    "RowParallelLinear",
    "product",
]
