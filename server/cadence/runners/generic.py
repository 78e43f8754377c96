"""The runner every model can use: its own forward, written against the layers."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cadence.attention_backends import AttentionBackend, StepLayout, forward_context


class ModelRunner:
    description = "generic forward"

    def __init__(self, model: nn.Module, attention: AttentionBackend[Any]) -> None:
        self.model = model
        self.attention = attention

    def forward(
        self, layout: StepLayout, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Flat token ids and positions [T] -> hidden states [T, hidden], rows ordered as
        the layout's (decode rows first)."""
        meta = self.attention.metadata(layout)
        with forward_context(self.attention, meta):
            return self.model(input_ids, positions)
