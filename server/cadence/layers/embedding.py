"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the
vocabulary rows."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cadence.layers.linear import product
from cadence.layers.parallel import tp_rank, tp_size

if TYPE_CHECKING:
    from cadence.quant.product import QuantizedProduct


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.tp_rank = tp_rank()
        self.tp_size = tp_size()
        self.shard_size = -(-vocab_size // self.tp_size)  # ceil: the last rank is padded
        self.start = self.tp_rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        rows = loaded[self.start : min(self.start + self.shard_size, self.vocab_size)]
        param.data[: rows.shape[0]].copy_(rows)
        param.data[rows.shape[0] :].zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.shard_size)
        y = F.embedding(local.clamp(0, self.shard_size - 1), self.weight)
        y = y * inside.unsqueeze(-1).to(y.dtype)
        dist.all_reduce(y)
        return y


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to logits over the whole vocabulary (gathered across ranks)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__(vocab_size, hidden_size)
        self.packed_weight: torch.Tensor | None = None  # see cadence.layers.packed
        self.packed_max_rows = 0  # rows up to which products read packed_weight
        # products of fewer rows are padded up to min_rows, of more split into max_rows:
        # a library kernel whose row bits change with the row count is kept to the range
        # where they do not (cadence.shard.determinism)
        self.min_rows = 1
        self.max_rows = 1 << 30
        self.quantized: QuantizedProduct | None = None  # as a LinearBase's (layers.linear)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        logits = product(self, hidden, None)
        if self.tp_size > 1:
            parts = [torch.empty_like(logits) for _ in range(self.tp_size)]
            dist.all_gather(parts, logits)
            logits = torch.cat(parts, dim=-1)
        return logits[..., : self.vocab_size]
