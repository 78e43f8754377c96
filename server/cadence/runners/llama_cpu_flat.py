"""The Llama family's step on CPU as one flat loop (see `cadence.models.llama_cpu_step`)."""

from __future__ import annotations

import torch

from cadence.attention_backends import StepLayout
from cadence.attention_backends.cpu_paged import CpuAttention
from cadence.models import llama_cpu_step
from cadence.models.llama import LlamaForCausalLM
from cadence.runners.generic import ModelRunner


class LlamaCpuFlatRunner(ModelRunner):
    description = "flat Llama step (C++ kernels)"

    def __init__(self, model: LlamaForCausalLM, attention: CpuAttention) -> None:
        super().__init__(model, attention)
        self.llama = model.model
        self.cpu_attention = attention

    def forward(
        self, layout: StepLayout, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        meta = self.cpu_attention.metadata(layout)
        return llama_cpu_step.forward_step(self.llama, input_ids, positions, meta)
