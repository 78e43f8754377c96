"""The cpu backend: decode rows read the cache through their block tables in place with
the C++ kernels of `cadence.kernels.cpu` (no gather, no mask); prefill rows take the
torch backend's padded SDPA, except short chunks (at most SHORT_CHUNK tokens: the few
tokens a grammar forced, a small chunk), each of whose tokens is a decode query of its own
over the context up to itself.

Batch-invariant (`every_query_on_cache`, the shard's --deterministic): every token of
every row is such a decode query, after the step's keys and values are written. A
query's output is then one kernel's fixed-order sum over its context as the cache holds
it (rounded to the cache's dtype), whatever else is in the step, however its prompt was
chunked and whether its prefix was computed now or read back from the prefix cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from cadence.attention_backends.base import AttentionBackend, StepLayout, Workspace
from cadence.attention_backends.torch_sdpa import PaddedPrefill, attend_prefill, write_kv
from cadence.kernels import cpu as cpu_kernels

if TYPE_CHECKING:
    from cadence.layers.attention import Attention


def _rows_as_decodes(
    layout: StepLayout, rows: int, tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `tokens` tokens (those of the first `rows` rows) each as a decode query:
    its row's block table and the context it sees (the row's cached tokens and its chunk's
    tokens up to itself). Each reads its context once, as a decode row does, where padded
    SDPA would gather every row's whole context and pad it to the longest chunk."""
    starts = layout.query_start[: rows + 1]
    q_lens = starts[1:] - starts[:-1]
    row = torch.repeat_interleave(
        torch.arange(rows, device=q_lens.device), q_lens, output_size=tokens
    )
    col = torch.arange(tokens, device=q_lens.device) - starts[row]
    lens = layout.context_lens[row] - q_lens[row] + col + 1
    blocks = max(layout.decode_blocks, layout.prefill_blocks)
    tables = layout.block_tables[:rows, :blocks].index_select(0, row)
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

    def __init__(
        self, workspace: Workspace | None = None, every_query_on_cache: bool = False
    ) -> None:
        self.workspace = workspace if workspace is not None else Workspace()
        self.every_query_on_cache = every_query_on_cache
        isa = cpu_kernels.selected_isa()
        self.description = (
            f"C++ {isa} paged attention, every query over the cache (batch-invariant)"
            if every_query_on_cache
            else f"C++ {isa} paged decode, torch SDPA prefill"
        )

    def metadata(self, layout: StepLayout) -> CpuMetadata:
        every_row = (
            self.every_query_on_cache and layout.num_decode < layout.num_decode + layout.num_prefill
        )
        if every_row or layout.num_short > 0:
            # every row (batch-invariant), or the decodes and the short chunks, on the decode
            # kernel; the rest, if any, padded
            rows = (
                int(layout.context_lens.shape[0])
                if every_row
                else layout.num_decode + layout.num_short
            )
            tokens = (
                int(layout.slot_mapping.shape[0])
                if every_row
                else layout.num_decode + layout.short_tokens
            )
            tables, lens = _rows_as_decodes(layout, rows, tokens)
            return CpuMetadata(
                slot_mapping=layout.slot_mapping.contiguous(),
                num_decode=tokens,
                decode_tables=tables,
                decode_lens=lens,
                prefill=None
                if every_row
                else PaddedPrefill.build(layout, self.workspace, rows, tokens),
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
        write_kv(
            k, v, layer.k_cache, layer.v_cache, meta.slot_mapping, layer.k_scale, layer.v_scale
        )

    def decode(
        self, layer: Attention, q: torch.Tensor, meta: CpuMetadata, out: torch.Tensor
    ) -> None:
        cpu_kernels.paged_decode_attention(
            q, layer.k_cache, layer.v_cache, meta.decode_tables, meta.decode_lens, layer.scale,
            layer.sliding_window, out=out, k_scale=layer.k_scale, v_scale=layer.v_scale,
        )  # fmt: skip

    def prefill(
        self, layer: Attention, q: torch.Tensor, meta: CpuMetadata, out: torch.Tensor
    ) -> None:
        attend_prefill(layer, q, meta.prefill, out)
