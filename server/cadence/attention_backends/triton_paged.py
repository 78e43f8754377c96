"""The triton backend: the step's KV write and the paged decode and prefill kernels of
`cadence.kernels`, reading the cache through the block tables (no gather, no padded copy
of any context). Importing it imports triton: CUDA, or tests under TRITON_INTERPRET=1."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from cadence.attention_backends.base import AttentionBackend, StepLayout
from cadence.kernels.decode_attention import decode_attention
from cadence.kernels.kv_write import kv_write
from cadence.kernels.prefill_attention import prefill_attention

if TYPE_CHECKING:
    from cadence.layers.attention import Attention


@dataclass(slots=True)
class TritonMetadata:
    slot_mapping: torch.Tensor  # [T]
    num_decode: int
    block_tables: torch.Tensor  # [B, max_blocks]: the kernels mask past each length inline
    context_lens: torch.Tensor  # [B]
    prefill_starts: torch.Tensor  # [Bp+1] query offsets of the prefill rows, from 0
    max_query_len: int


class TritonAttention(AttentionBackend[TritonMetadata]):
    name = "triton"
    description = "triton paged decode + prefill"

    def metadata(self, layout: StepLayout) -> TritonMetadata:
        d = layout.num_decode
        return TritonMetadata(
            slot_mapping=layout.slot_mapping,
            num_decode=d,
            block_tables=layout.block_tables,
            context_lens=layout.context_lens,
            prefill_starts=layout.query_start[d:] - layout.query_start[d],
            max_query_len=layout.max_query_len,
        )

    def write_kv(
        self, layer: Attention, k: torch.Tensor, v: torch.Tensor, meta: TritonMetadata
    ) -> None:
        kv_write(
            k, v, layer.k_cache, layer.v_cache, meta.slot_mapping, layer.k_scale, layer.v_scale
        )

    def decode(
        self, layer: Attention, q: torch.Tensor, meta: TritonMetadata, out: torch.Tensor
    ) -> None:
        d = meta.num_decode
        decode_attention(
            q, layer.k_cache, layer.v_cache, meta.block_tables[:d], meta.context_lens[:d],
            layer.scale, window=layer.sliding_window, out=out, k_scale=layer.k_scale,
            v_scale=layer.v_scale,
        )  # fmt: skip

    def prefill(
        self, layer: Attention, q: torch.Tensor, meta: TritonMetadata, out: torch.Tensor
    ) -> None:
        d = meta.num_decode
        prefill_attention(
            q, layer.k_cache, layer.v_cache, meta.block_tables[d:], meta.prefill_starts,
            meta.context_lens[d:], meta.max_query_len, layer.scale, window=layer.sliding_window,
            out=out, k_scale=layer.k_scale, v_scale=layer.v_scale,
        )  # fmt: skip
