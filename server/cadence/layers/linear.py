"""Linear layers in the vLLM shape, each parameter with its own `weight_loader`.

A loader receives the checkpoint tensor as a safetensors slice (or a plain tensor) and
reads only this rank's part of it. With one rank every layer is a plain linear layer;
column-parallel layers split the output dimension, row-parallel layers split the input
dimension and all-reduce their output.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cadence.layers.packed import linear
from cadence.layers.parallel import balanced_split, divide, tp_rank, tp_size

# A checkpoint tensor: a safetensors slice (indexable, read lazily) or a torch tensor.
Loaded = Any


def _rows(loaded: Loaded, start: int, size: int) -> torch.Tensor:
    """Rows [start, start+size) of a checkpoint tensor, reading only those rows."""
    return loaded[start : start + size]


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != {tuple(dst.shape)}")
    dst.copy_(src)


class LinearBase(nn.Module):
    """Holds `weight` [out, in] (and `bias` [out]) created empty, filled by the loaders."""

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

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: Any = None) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed_weight)


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight."""

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: Any = None) -> None:
        _copy(param.data, loaded[:], "replicated linear")


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, divide(out_features, tp_size()), bias)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: Any = None) -> None:
        size = param.shape[0]
        _copy(param.data, _rows(loaded, self.tp_rank * size, size), "column-parallel linear")


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul
    (gate and up of a SwiGLU MLP); `shard_id` is the index of the projection."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: Any = None) -> None:
        assert isinstance(shard_id, int)
        offset = divide(sum(self.output_sizes[:shard_id]), self.tp_size)
        size = divide(self.output_sizes[shard_id], self.tp_size)
        src = _rows(loaded, self.tp_rank * size, size)
        _copy(param.data.narrow(0, offset, size), src, f"merged linear part {shard_id}")


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

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: Any = None) -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, start = 0, q_size, self.q_heads[0] * self.head_dim
        elif shard_id in ("k", "v"):
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, start = kv_size, self.kv_start * self.head_dim
        else:
            raise ValueError(f"unknown qkv shard {shard_id!r}")
        _copy(param.data.narrow(0, offset, size), _rows(loaded, start, size), f"qkv {shard_id}")


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
        super().__init__(input_split[1], out_features, bias)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: Any = None) -> None:
        if param.dim() == 1:  # bias: replicated
            _copy(param.data, loaded[:], "row-parallel bias")
            return
        start, size = self.input_start, param.shape[1]
        _copy(param.data, loaded[:, start : start + size], "row-parallel linear")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias if self.tp_rank == 0 else None, self.packed_weight)
        if self.tp_size > 1:
            dist.all_reduce(y)
        return y


__all__ = [
    "ColumnParallelLinear",
    "LinearBase",
    "MergedColumnParallelLinear",
    "QKVLinear",
    "ReplicatedLinear",
    "RowParallelLinear",
]
