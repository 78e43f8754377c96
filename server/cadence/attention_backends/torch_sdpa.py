"""The torch backend: each sequence's context gathered through its block table into a
padded tensor, then one `scaled_dot_product_attention` for all decode rows and one for
all prefill rows. Runs on any device; the CPU fallback when the C++ kernels cannot
build, and the prefill half of the `cpu` backend."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from cadence.attention_backends.base import AttentionBackend, StepLayout, Workspace
from cadence.kv_format import as_bytes, dequantize, quantize_fp8, quantize_int8

if TYPE_CHECKING:
    from cadence.layers.attention import Attention


@dataclass(slots=True)
class PaddedPrefill:
    """The prefill rows padded to [Bp, max_query_len] query slots, with their masks."""

    context_lens: torch.Tensor  # [Bp]
    query_start: torch.Tensor  # [Bp+1], offsets into the whole step's tokens
    tables: torch.Tensor  # [Bp, blocks the prefills need]
    mask: torch.Tensor  # [Bp, 1, max_q, L] key is visible
    seq: torch.Tensor  # [Tp] prefill sequence of each prefill token
    col: torch.Tensor  # [Tp] index of each token within its chunk
    max_query_len: int
    from_start: bool  # no row has a cached prefix: SDPA's causal kernel, no mask
    workspace: Workspace | None
    # sliding-window masks, built on first use per window size
    windowed: dict[int, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        layout: StepLayout,
        workspace: Workspace | None,
        first_row: int | None = None,
        first_token: int | None = None,
    ) -> PaddedPrefill | None:
        """The rows from `first_row` on (default: every prefill row), whose queries start
        at token `first_token` (default: right after the decodes' one token each)."""
        d = layout.num_decode if first_row is None else first_row
        n = int(layout.context_lens.shape[0]) - d
        if n == 0:
            return None
        device = layout.context_lens.device
        keys = torch.arange(layout.prefill_blocks * layout.block_size, device=device)
        starts = layout.query_start[d:]
        q_lens = starts[1:] - starts[:-1]
        num_tokens = layout.slot_mapping.shape[0] - (d if first_token is None else first_token)
        seq = torch.repeat_interleave(
            torch.arange(n, device=device), q_lens, output_size=num_tokens
        )
        col = torch.arange(num_tokens, device=device) - (starts[seq] - starts[0])
        lens = layout.context_lens[d:]
        # absolute position of query i of sequence b: context_len - q_len + i
        first = (lens - q_lens).view(-1, 1, 1)
        pos = first + torch.arange(layout.max_query_len, device=device).view(1, -1, 1)
        mask = (keys.view(1, 1, -1) <= pos).unsqueeze(1)
        return cls(
            context_lens=lens,
            query_start=starts,
            tables=layout.block_tables[d:, : layout.prefill_blocks],
            mask=mask,
            seq=seq,
            col=col,
            max_query_len=layout.max_query_len,
            from_start=layout.prefill_from_start,
            workspace=workspace,
        )

    def mask_for(self, window: int | None) -> torch.Tensor:
        """With a sliding `window`, a query at position p sees only keys k with
        p - window < k <= p (Mistral's convention)."""
        if window is None:
            return self.mask
        if window not in self.windowed:
            device = self.context_lens.device
            q_lens = self.query_start[1:] - self.query_start[:-1]
            first = (self.context_lens - q_lens).view(-1, 1, 1)
            pos = first + torch.arange(self.max_query_len, device=device).view(1, -1, 1)
            keys = torch.arange(self.mask.shape[-1], device=device).view(1, 1, -1)
            self.windowed[window] = self.mask & (keys > pos - window).unsqueeze(1)
        return self.windowed[window]


@dataclass(slots=True)
class PaddedDecode:
    """The decode rows' contexts padded to the longest, with the mask of real keys."""

    context_lens: torch.Tensor  # [Bd]
    tables: torch.Tensor  # [Bd, blocks the decodes need]
    mask: torch.Tensor  # [Bd, 1, 1, L] key is visible
    workspace: Workspace | None
    windowed: dict[int, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def build(cls, layout: StepLayout, workspace: Workspace | None) -> PaddedDecode | None:
        d = layout.num_decode
        if d == 0:
            return None
        device = layout.context_lens.device
        keys = torch.arange(layout.decode_blocks * layout.block_size, device=device)
        lens = layout.context_lens[:d]
        return cls(
            context_lens=lens,
            tables=layout.block_tables[:d, : layout.decode_blocks],
            mask=(keys < lens.unsqueeze(1)).view(d, 1, 1, -1),
            workspace=workspace,
        )

    def mask_for(self, window: int | None) -> torch.Tensor:
        if window is None:
            return self.mask
        if window not in self.windowed:
            d = self.context_lens.shape[0]
            keys = torch.arange(self.mask.shape[-1], device=self.context_lens.device)
            first = (self.context_lens - window).view(d, 1, 1, 1)  # query at lens - 1
            self.windowed[window] = self.mask & (keys.view(1, 1, 1, -1) >= first)
        return self.windowed[window]


@dataclass(slots=True)
class TorchMetadata:
    slot_mapping: torch.Tensor
    num_decode: int
    decode: PaddedDecode | None
    prefill: PaddedPrefill | None


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Stores new keys/values ([T, kv_heads, head_dim]) at their slots, quantized when the
    cache is (`cadence.kv_format`): int8 writes each token's scales into k_scale/v_scale
    [blocks, block_size, kv_heads]; fp8 reads its layer's scale from them."""
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        if scale is None:
            stored, row_scales = x.to(cache.dtype), None
        elif cache.dtype == torch.int8:
            stored, row_scales = quantize_int8(x)
        else:
            stored, row_scales = quantize_fp8(x, scale, cache.dtype), None
        flat = as_bytes(cache).view(-1, *cache.shape[2:])
        flat.index_copy_(0, slot_mapping, as_bytes(stored))
        if row_scales is not None:
            assert scale is not None
            scale.view(-1, scale.shape[-1]).index_copy_(0, slot_mapping, row_scales)


def gather(
    cache: torch.Tensor,
    tables: torch.Tensor,
    dtype: torch.dtype,
    out: torch.Tensor | None,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """[B, kv_heads, blocks * block_size, head_dim]: each sequence's context, copied block
    by block through its block table (into `out` when given), dequantized with `scale`
    (a quantized cache's per-token scales, gathered the same way, or its layer scale)."""
    b, n = tables.shape
    flat = cache.view(cache.shape[0], -1)
    rows = torch.index_select(flat, 0, tables.reshape(-1), out=out)
    x = rows.view(b, n * cache.shape[1], cache.shape[2], cache.shape[3])
    if scale is not None:
        if scale.dim() > 1:  # per token: [blocks, block_size, kv_heads]
            scale = scale.view(scale.shape[0], -1).index_select(0, tables.reshape(-1))
            scale = scale.view(b, n * cache.shape[1], cache.shape[2])
        x = dequantize(x, scale, dtype)
    return x.transpose(1, 2).to(dtype)


def _scratch(
    workspace: Workspace | None, name: str, cache: torch.Tensor, tables: torch.Tensor
) -> torch.Tensor | None:
    if workspace is None:
        return None
    shape = (tables.numel(), cache[0].numel())
    return workspace.get(name, shape, cache.dtype, cache.device)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    workspace: Workspace | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [B, heads, head_dim], one query per sequence -> [B, heads, head_dim]; a
    quantized cache's scales in k_scale/v_scale."""
    k_tmp = _scratch(workspace, "decode_k", k_cache, block_tables)
    v_tmp = _scratch(workspace, "decode_v", v_cache, block_tables)
    k = gather(k_cache, block_tables, q.dtype, k_tmp, k_scale)
    v = gather(v_cache, block_tables, q.dtype, v_tmp, v_scale)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out.squeeze(2)


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    p: PaddedPrefill,
    scale: float,
    sliding_window: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [Tp, heads, head_dim], the prefill tokens, packed -> same shape; causal, within
    `sliding_window` when given; a quantized cache's scales in k_scale/v_scale."""
    padded = q.new_zeros(p.tables.shape[0], p.max_query_len, q.shape[1], q.shape[2])
    padded[p.seq, p.col] = q
    k_tmp = _scratch(p.workspace, "prefill_k", k_cache, p.tables)
    v_tmp = _scratch(p.workspace, "prefill_v", v_cache, p.tables)
    k = gather(k_cache, p.tables, q.dtype, k_tmp, k_scale)
    v = gather(v_cache, p.tables, q.dtype, v_tmp, v_scale)
    if p.from_start and sliding_window is None:
        # Whole prompts: query i sees keys 0..i of its own chunk, which SDPA's causal
        # kernel does without a mask and skipping the masked half (padded query rows
        # see pad keys, and are dropped below).
        n = p.max_query_len
        out = F.scaled_dot_product_attention(
            padded.transpose(1, 2), k[:, :, :n], v[:, :, :n], is_causal=True, scale=scale,
            enable_gqa=True,
        )  # fmt: skip
    else:
        out = F.scaled_dot_product_attention(
            padded.transpose(1, 2), k, v, attn_mask=p.mask_for(sliding_window), scale=scale,
            enable_gqa=True,
        )  # fmt: skip
    return out.transpose(1, 2)[p.seq, p.col]


def attend_prefill(
    layer: Attention, q: torch.Tensor, p: PaddedPrefill | None, out: torch.Tensor
) -> None:
    """The prefill rows of `layer` through padded SDPA, into `out` (the torch and cpu
    backends' prefill)."""
    assert p is not None
    out.copy_(
        prefill_attention(
            q,
            layer.k_cache,
            layer.v_cache,
            p,
            layer.scale,
            layer.sliding_window,
            layer.k_scale,
            layer.v_scale,
        )  # fmt: skip
    )


class TorchAttention(AttentionBackend[TorchMetadata]):
    name = "torch"
    description = "torch gather + SDPA"

    def __init__(self, workspace: Workspace | None = None) -> None:
        self.workspace = workspace if workspace is not None else Workspace()

    def metadata(self, layout: StepLayout) -> TorchMetadata:
        return TorchMetadata(
            slot_mapping=layout.slot_mapping,
            num_decode=layout.num_decode,
            decode=PaddedDecode.build(layout, self.workspace),
            prefill=PaddedPrefill.build(layout, self.workspace),
        )

    def write_kv(
        self, layer: Attention, k: torch.Tensor, v: torch.Tensor, meta: TorchMetadata
    ) -> None:
        write_kv(
            k, v, layer.k_cache, layer.v_cache, meta.slot_mapping, layer.k_scale, layer.v_scale
        )

    def decode(
        self, layer: Attention, q: torch.Tensor, meta: TorchMetadata, out: torch.Tensor
    ) -> None:
        d = meta.decode
        assert d is not None
        mask = d.mask_for(layer.sliding_window)
        out.copy_(
            decode_attention(
                q,
                layer.k_cache,
                layer.v_cache,
                d.tables,
                mask,
                layer.scale,
                d.workspace,
                layer.k_scale,
                layer.v_scale,
            )  # fmt: skip
        )

    def prefill(
        self, layer: Attention, q: torch.Tensor, meta: TorchMetadata, out: torch.Tensor
    ) -> None:
        attend_prefill(layer, q, meta.prefill, out)
