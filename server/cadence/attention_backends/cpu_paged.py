"""The cpu backend: decode rows read the cache through their block tables in place with
the C++ kernels of `cadence.kernels.cpu` (no gather, no mask); prefill rows take the
torch backend's padded SDPA."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from cadence.attention_backends.base import AttentionBackend, StepLayout, Workspace
from cadence.attention_backends.torch_sdpa import PaddedPrefill, attend_prefill, write_kv
from cadence.kernels import cpu as cpu_kernels

if TYPE_CHECKING:
    from cadence.layers.attention import Attention


@dataclass(slots=True)
class CpuMetadata:
    slot_mapping: torch.Tensor  # [T], contiguous
    num_decode: int
    decode_tables: torch.Tensor  # [Bd, blocks the decodes need], rows contiguous
    decode_lens: torch.Tensor  # [Bd], contiguous
    prefill: PaddedPrefill | None


class CpuAttention(AttentionBackend[CpuMetadata]):
    name = "cpu"

    def __init__(self, workspace: Workspace | None = None) -> None:
        self.workspace = workspace if workspace is not None else Workspace()
        isa = cpu_kernels.selected_isa()
        self.description = f"C++ {isa} paged decode, torch SDPA prefill"

    def metadata(self, layout: StepLayout) -> CpuMetadata:
        d = layout.num_decode
        tables = layout.block_tables[:d, : layout.decode_blocks]
        if tables.stride(1) != 1:
            tables = tables.contiguous()
        return CpuMetadata(
            slot_mapping=layout.slot_mapping.contiguous(),
            num_decode=d,
            decode_tables=tables,
            decode_lens=layout.context_lens[:d].contiguous(),
            prefill=PaddedPrefill.build(layout, self.workspace),
        )

    def write_kv(
        self, layer: Attention, k: torch.Tensor, v: torch.Tensor, meta: CpuMetadata
    ) -> None:
        write_kv(k, v, layer.k_cache, layer.v_cache, meta.slot_mapping)

    def decode(
        self, layer: Attention, q: torch.Tensor, meta: CpuMetadata, out: torch.Tensor
    ) -> None:
        cpu_kernels.paged_decode_attention(
            q, layer.k_cache, layer.v_cache, meta.decode_tables, meta.decode_lens, layer.scale,
            layer.sliding_window, out=out,
        )  # fmt: skip

    def prefill(
        self, layer: Attention, q: torch.Tensor, meta: CpuMetadata, out: torch.Tensor
    ) -> None:
        attend_prefill(layer, q, meta.prefill, out)
