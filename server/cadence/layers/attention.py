"""The attention interface over the paged KV cache, torch CPU backend.

Per layer the cache is a key and a value tensor `[num_blocks, block_size, kv_heads,
head_dim]`; a token's slot is `block * block_size + offset`. Each step builds ONE
`AttentionContext` (flat slot mapping, query start offsets, context lengths, padded
block tables, and the masks derived from them) and installs it with `forward_context`;
every `Attention` layer reads it from there.

Rows are ordered so the single-token (decode) sequences come first: they take the
`decode_attention` fast path, the rest go through `prefill_attention`, where the
queries of a chunk attend to the cached prefix and causally to themselves. Both gather
each sequence's context through its block table into a padded tensor and call
`scaled_dot_product_attention` once for the whole batch.

The backend is chosen per engine (`select_backend`): `torch` (above), `cpu` (the default
on CPU when the C++ kernels of `cadence.kernels.cpu` build: decode rows read the cache
through their block tables in place, prefill rows take the torch path) or `triton` (the
paged kernels of `cadence.kernels`, which read the cache through the block tables
without a gather; the default on CUDA). All sit behind the same interface.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


class Workspace:
    """Scratch tensors reused by every layer and every step (grown, never shrunk), so
    the per-layer context gathers do not allocate and fault in fresh pages each time."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        n = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < n or buf.dtype != dtype or buf.device != device:
            size = max(n, 2 * buf.numel()) if buf is not None and buf.dtype == dtype else n
            buf = torch.empty(size, dtype=dtype, device=device)
            self._buffers[name] = buf
        return buf[:n].view(shape)


@dataclass(slots=True)
class AttentionContext:
    slot_mapping: torch.Tensor  # [T] int64: cache slot each new token's K/V goes to
    query_start: torch.Tensor  # [B+1] int64: token offsets of each sequence's queries
    context_lens: torch.Tensor  # [B] int64: tokens in cache after this step, per sequence
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with block 0
    block_size: int
    num_decode: int  # the first num_decode sequences (and tokens) have one query each
    max_query_len: int  # over the prefill sequences
    prefill_from_start: bool = False  # no prefill row has a cached prefix: plain causal
    decode_tables: torch.Tensor | None = None  # [Bd, blocks the decodes need]
    prefill_tables: torch.Tensor | None = None  # [Bp, blocks the prefills need]
    decode_mask: torch.Tensor | None = None  # [Bd, 1, 1, L] key is visible
    prefill_mask: torch.Tensor | None = None  # [Bp, 1, max_q, L]
    prefill_seq: torch.Tensor | None = None  # [Tp] prefill sequence of each prefill token
    prefill_col: torch.Tensor | None = None  # [Tp] index of each token within its chunk
    workspace: Workspace | None = None
    backend: str = "torch"  # "torch" | "cpu" | "triton"
    # sliding-window masks, built on first use per window size: window -> (decode, prefill)
    windowed: dict[int, tuple[torch.Tensor | None, torch.Tensor | None]] = field(
        default_factory=dict
    )

    @classmethod
    def build(
        cls,
        slot_mapping: torch.Tensor,
        query_start: torch.Tensor,
        context_lens: torch.Tensor,
        block_tables: torch.Tensor,
        block_size: int,
        num_decode: int,
        max_query_len: int,
        decode_blocks: int,
        prefill_blocks: int,
        prefill_from_start: bool = False,
        workspace: Workspace | None = None,
        backend: str = "torch",
    ) -> AttentionContext:
        """Derives the masks and padding indices once per step (shared by every layer).
        The Python ints (longest prefill chunk, blocks spanned by the longest decode and
        prefill context) come from the caller, who knows them without a device sync."""
        ctx = cls(
            slot_mapping,
            query_start,
            context_lens,
            block_tables,
            block_size,
            num_decode,
            max_query_len,
            prefill_from_start=prefill_from_start,
            workspace=workspace,
            backend=backend,
        )
        if backend == "triton":  # the kernels read block_tables directly and mask inline
            return ctx
        device = context_lens.device
        if num_decode > 0 and backend == "cpu":  # the kernel reads the tables, masks inline
            ctx.decode_tables = block_tables[:num_decode, :decode_blocks]
        elif num_decode > 0:
            ctx.decode_tables = block_tables[:num_decode, :decode_blocks]
            keys = torch.arange(decode_blocks * block_size, device=device)
            lens = context_lens[:num_decode]
            ctx.decode_mask = (keys < lens.unsqueeze(1)).view(num_decode, 1, 1, -1)
        num_prefill = context_lens.shape[0] - num_decode
        if num_prefill > 0:
            ctx.prefill_tables = block_tables[num_decode:, :prefill_blocks]
            keys = torch.arange(prefill_blocks * block_size, device=device)
            starts = query_start[num_decode:]
            q_lens = starts[1:] - starts[:-1]
            num_tokens = slot_mapping.shape[0] - num_decode
            seq = torch.repeat_interleave(
                torch.arange(num_prefill, device=device), q_lens, output_size=num_tokens
            )
            ctx.prefill_seq = seq
            ctx.prefill_col = torch.arange(num_tokens, device=device) - (starts[seq] - starts[0])
            # absolute position of query i of sequence b: context_len - q_len + i
            first = (context_lens[num_decode:] - q_lens).view(-1, 1, 1)
            pos = first + torch.arange(max_query_len, device=device).view(1, -1, 1)
            ctx.prefill_mask = (keys.view(1, 1, -1) <= pos).unsqueeze(1)
        return ctx

    def masks(self, window: int | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(decode, prefill) masks; with a sliding `window`, a query at position p sees
        only keys k with p - window < k <= p (Mistral's convention)."""
        if window is None:
            return self.decode_mask, self.prefill_mask
        if window not in self.windowed:
            self.windowed[window] = (self._windowed_decode(window), self._windowed_prefill(window))
        return self.windowed[window]

    def _windowed_decode(self, window: int) -> torch.Tensor | None:
        if self.decode_mask is None:
            return None
        d = self.num_decode
        keys = torch.arange(self.decode_mask.shape[-1], device=self.context_lens.device)
        first = (self.context_lens[:d] - window).view(d, 1, 1, 1)  # query at lens - 1
        return self.decode_mask & (keys.view(1, 1, 1, -1) >= first)

    def _windowed_prefill(self, window: int) -> torch.Tensor | None:
        if self.prefill_mask is None:
            return None
        d = self.num_decode
        device = self.context_lens.device
        starts = self.query_start[d:]
        q_lens = starts[1:] - starts[:-1]
        first = (self.context_lens[d:] - q_lens).view(-1, 1, 1)
        pos = first + torch.arange(self.max_query_len, device=device).view(1, -1, 1)
        keys = torch.arange(self.prefill_mask.shape[-1], device=device).view(1, 1, -1)
        return self.prefill_mask & (keys > pos - window).unsqueeze(1)


BACKENDS = ("auto", "torch", "cpu", "triton")


def select_backend(requested: str | None, device: torch.device) -> str:
    """`auto` (or None): triton on CUDA when triton imports; on CPU `cpu` when the C++
    kernels build, else torch. `triton` on a CPU device needs `TRITON_INTERPRET=1`
    (tests only: the interpreter is slow)."""
    requested = (requested or "auto").lower()
    if requested not in BACKENDS:
        raise ValueError(f"unknown attention backend {requested!r} (one of {BACKENDS})")
    if requested == "cpu":
        from cadence.kernels import cpu

        if device.type != "cpu":
            raise ValueError("the cpu attention backend runs on CPU devices only")
        if not cpu.available():
            reason = cpu.unavailable_reason()
            raise ValueError(f"the cpu attention backend is unavailable: {reason}")
    if requested != "auto":
        if requested == "triton" and device.type != "cuda":
            if os.environ.get("TRITON_INTERPRET", "0") != "1":
                raise ValueError("the triton attention backend on CPU needs TRITON_INTERPRET=1")
        return requested
    if device.type == "cpu":
        from cadence.kernels import cpu

        return "cpu" if cpu.available() else "torch"
    from cadence.kernels import triton_available

    return "triton" if device.type == "cuda" and triton_available() else "torch"


_CONTEXT: AttentionContext | None = None


@contextmanager
def forward_context(ctx: AttentionContext) -> Iterator[None]:
    """Installs the step's attention context for the duration of one forward."""
    global _CONTEXT
    previous, _CONTEXT = _CONTEXT, ctx
    try:
        yield
    finally:
        _CONTEXT = previous


def current_context() -> AttentionContext | None:
    """The step's attention context, or None outside `forward_context`."""
    return _CONTEXT


def get_context() -> AttentionContext:
    if _CONTEXT is None:
        raise RuntimeError("attention called outside forward_context()")
    return _CONTEXT


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Stores new keys/values ([T, kv_heads, head_dim]) at their slots."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _gather(
    cache: torch.Tensor, tables: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None
) -> torch.Tensor:
    """[B, kv_heads, blocks * block_size, head_dim]: each sequence's context, copied block
    by block through its block table (into `out` when given)."""
    b, n = tables.shape
    flat = cache.view(cache.shape[0], -1)
    rows = torch.index_select(flat, 0, tables.reshape(-1), out=out)
    x = rows.view(b, n * cache.shape[1], cache.shape[2], cache.shape[3]).transpose(1, 2)
    return x.to(dtype)


def _scratch(name: str, cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor | None:
    ws = get_context().workspace if _CONTEXT is not None else None
    if ws is None:
        return None
    shape = (tables.numel(), math.prod(cache.shape[1:]))
    return ws.get(name, shape, cache.dtype, cache.device)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q: [B, heads, head_dim], one query per sequence -> [B, heads, head_dim]."""
    k = _gather(k_cache, block_tables, q.dtype, _scratch("decode_k", k_cache, block_tables))
    v = _gather(v_cache, block_tables, q.dtype, _scratch("decode_v", v_cache, block_tables))
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out.squeeze(2)


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    ctx: AttentionContext,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """q: [Tp, heads, head_dim], the prefill tokens, packed -> same shape; causal, within
    `sliding_window` when given."""
    assert ctx.prefill_seq is not None and ctx.prefill_col is not None
    mask = ctx.masks(sliding_window)[1]
    tables = ctx.prefill_tables
    assert tables is not None
    padded = q.new_zeros(tables.shape[0], ctx.max_query_len, q.shape[1], q.shape[2])
    padded[ctx.prefill_seq, ctx.prefill_col] = q
    k = _gather(k_cache, tables, q.dtype, _scratch("prefill_k", k_cache, tables))
    v = _gather(v_cache, tables, q.dtype, _scratch("prefill_v", v_cache, tables))
    if ctx.prefill_from_start and sliding_window is None:
        # Whole prompts: query i sees keys 0..i of its own chunk, which SDPA's causal
        # kernel does without a mask and skipping the masked half (padded query rows
        # see pad keys, and are dropped below).
        n = ctx.max_query_len
        out = F.scaled_dot_product_attention(
            padded.transpose(1, 2), k[:, :, :n], v[:, :, :n], is_causal=True, scale=scale,
            enable_gqa=True,
        )  # fmt: skip
    else:
        out = F.scaled_dot_product_attention(
            padded.transpose(1, 2), k, v, attn_mask=mask, scale=scale, enable_gqa=True
        )
    return out.transpose(1, 2)[ctx.prefill_seq, ctx.prefill_col]


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention for a mixed batch (decode rows first): q [T, heads, head_dim]."""
    ctx = get_context()
    d = ctx.num_decode
    if d > 0 and ctx.backend == "cpu":
        from cadence.kernels import cpu

        assert ctx.decode_tables is not None
        decode = cpu.paged_decode_attention(
            q[:d], k_cache, v_cache, ctx.decode_tables, ctx.context_lens[:d], scale,
            sliding_window,
        )  # fmt: skip
        if d == q.shape[0]:
            return decode
    elif d > 0:
        decode_mask = ctx.masks(sliding_window)[0]
        assert ctx.decode_tables is not None and decode_mask is not None
        decode = decode_attention(q[:d], k_cache, v_cache, ctx.decode_tables, decode_mask, scale)
        if d == q.shape[0]:
            return decode
    prefill = prefill_attention(q[d:], k_cache, v_cache, ctx, scale, sliding_window)
    if d == 0:
        return prefill
    return torch.cat((decode, prefill), dim=0)


class Attention(nn.Module):
    """One layer's attention over its slice of the paged cache. The engine assigns
    `k_cache` and `v_cache` once the cache is allocated."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window  # None: full causal attention
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, heads, head_dim], k/v: [T, kv_heads, head_dim] -> [T, heads * head_dim]."""
        ctx = get_context()
        if ctx.backend == "triton":
            from cadence.layers import triton_attention  # imports triton: CUDA or tests only

            out = triton_attention.forward(
                q, k, v, self.k_cache, self.v_cache, ctx, self.scale, self.sliding_window
            )
            return out.reshape(q.shape[0], -1)
        write_kv(k, v, self.k_cache, self.v_cache, ctx.slot_mapping)
        out = paged_attention(q, self.k_cache, self.v_cache, self.scale, self.sliding_window)
        return out.reshape(q.shape[0], -1)
