"""The cpu backend: decode rows read the cache through their block tables in place with
the C++ kernels of `cadence.kernels.cpu` (no gather, no mask); prefill rows take the
torch backend's padded SDPA, unless every prefill row is short (a few tokens a grammar
forced, a small chunk): then each of their tokens is a decode query of its own over the
context up to itself, and the whole step runs on the decode kernels."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from cadence.attention_backends.base import AttentionBackend, StepLayout, Workspace
from cadence.attention_backends.torch_sdpa import PaddedPrefill, attend_prefill, write_kv
from cadence.kernels import cpu as cpu_kernels

if TYPE_CHECKING:
    from cadence.layers.attention import Attention


# Prefill rows of at most this many tokens are attended token by token with the decode
# kernel (each token reads its context once, as a decode row does) instead of gathering
# every row's whole context for padded SDPA, which costs as much for 2 tokens as for 200.
SHORT_CHUNK = 16


def _short_rows_as_decodes(layout: StepLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token of the step as a decode query: its row's block table and the context
    it sees (its row's cached tokens and the chunk's tokens up to itself)."""
    starts = layout.query_start
    q_lens = starts[1:] - starts[:-1]
    tokens = int(layout.slot_mapping.shape[0])
    row = torch.repeat_interleave(
        torch.arange(q_lens.shape[0], device=q_lens.device), q_lens, output_size=tokens
    )
    col = torch.arange(tokens, device=q_lens.device) - starts[row]
    lens = layout.context_lens[row] - q_lens[row] + col + 1
    blocks = max(layout.decode_blocks, layout.prefill_blocks)
    tables = layout.block_tables[:, :blocks].index_select(0, row)
    return tables, lens


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
        if layout.num_prefill > 0 and layout.max_query_len <= SHORT_CHUNK:
            tables, lens = _short_rows_as_decodes(layout)
            return CpuMetadata(
                slot_mapping=layout.slot_mapping.contiguous(),
                num_decode=int(lens.shape[0]),
                decode_tables=tables,
                decode_lens=lens,
                prefill=None,
            )
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
