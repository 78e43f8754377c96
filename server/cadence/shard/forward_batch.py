"""The flat inputs of one target-model forward (`BatchState.prepare`), on CPU: the
scheduled rows' tokens, their `StepLayout`, and which rows sample (the engine moves what
the device needs)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cadence.attention_backends import StepLayout


@dataclass(slots=True)
class ForwardBatch:
    ids: list[int]  # request id of each scheduled row (decode rows first)
    slots: torch.Tensor  # [B]
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    layout: StepLayout  # on CPU
    sample_rows: torch.Tensor  # [R] rows that sample
    sample_tokens: torch.Tensor  # [R] their last token's index in the flat batch
    num_prompt_tokens: int = 0  # tokens at positions < their request's prompt_len
    # speculative steps only (None otherwise): proposals per sampling row [R], and the
    # flat indices of each sampling row's 1 + k verified positions, rows in order [sum(1 + k)]
    num_proposed: torch.Tensor | None = None
    verify_tokens: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def query_start(self) -> torch.Tensor:
        """[B+1] the rows' token offsets (the layout's)."""
        return self.layout.query_start
