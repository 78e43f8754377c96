"""What every attention backend is: the step's flat layout in, per-backend metadata built
once per step, and write_kv / decode / prefill per layer."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import torch

if TYPE_CHECKING:
    from cadence.layers.attention import Attention


# Prompt chunks of at most this many tokens (what a grammar's forced tokens make) are
# "short": the shard orders them right after the decodes, and a backend may attend them
# token by token as decode queries rather than padding them to the longest chunk.
SHORT_CHUNK = 16


@dataclass(slots=True)
class StepLayout:
    """Where one step's tokens sit: built on CPU (`cadence.shard.flat_rows`), handed to
    the backends on the model's device (`to`). Rows are ordered so the single-token
    (decode) sequences come first, then the short chunks (at most SHORT_CHUNK tokens),
    then the longer ones. The Python ints come from the caller, who knows them without a
    device sync."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot each new token's K/V goes to
    query_start: torch.Tensor  # [B+1] int64: token offsets of each sequence's queries
    context_lens: torch.Tensor  # [B] int64: tokens in cache after this step, per sequence
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with block 0
    block_size: int
    num_decode: int  # the first num_decode sequences (and tokens) have one query each
    max_query_len: int  # over the prefill sequences
    decode_blocks: int  # blocks spanned by the longest decode context
    prefill_blocks: int  # blocks spanned by the longest prefill context
    prefill_from_start: bool = False  # no prefill row has a cached prefix: plain causal
    num_short: int = 0  # rows after the decodes with 2..SHORT_CHUNK queries
    short_tokens: int = 0  # their tokens

    @property
    def num_prefill(self) -> int:
        return int(self.context_lens.shape[0]) - self.num_decode

    def to(self, device: torch.device) -> StepLayout:
        """This layout with its tensors on `device` (copies that do not wait for the
        device), its ints as they are; itself where they are there already (the CPU
        shard's every step)."""
        if self.slot_mapping.device == device:
            return self
        return StepLayout(
            slot_mapping=self.slot_mapping.to(device, non_blocking=True),
            query_start=self.query_start.to(device, non_blocking=True),
            context_lens=self.context_lens.to(device, non_blocking=True),
            block_tables=self.block_tables.to(device, non_blocking=True),
            block_size=self.block_size,
            num_decode=self.num_decode,
            max_query_len=self.max_query_len,
            decode_blocks=self.decode_blocks,
            prefill_blocks=self.prefill_blocks,
            prefill_from_start=self.prefill_from_start,
            num_short=self.num_short,
            short_tokens=self.short_tokens,
        )


class Workspace:
    """Scratch tensors reused by every layer and every step (grown, never shrunk), so
    per-layer context gathers do not allocate and fault in fresh pages each time."""

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


class StepMetadata(Protocol):
    num_decode: int  # the first num_decode rows are decode rows, one query each


M = TypeVar("M", bound=StepMetadata)


class AttentionBackend(ABC, Generic[M]):
    """One implementation of paged attention. `name` is what `--attention-backend` calls
    it; `description` is what the shard reports serving its attention."""

    name: str
    description: str

    @abstractmethod
    def metadata(self, layout: StepLayout) -> M:
        """Everything the layers need beyond the layout, derived once per step."""

    @abstractmethod
    def write_kv(self, layer: Attention, k: torch.Tensor, v: torch.Tensor, meta: M) -> None:
        """Stores the step's new keys/values [T, kv_heads, head_dim] in their slots."""

    @abstractmethod
    def decode(self, layer: Attention, q: torch.Tensor, meta: M, out: torch.Tensor) -> None:
        """q: [Bd, heads, head_dim], the decode rows' queries -> out (same shape)."""

    @abstractmethod
    def prefill(self, layer: Attention, q: torch.Tensor, meta: M, out: torch.Tensor) -> None:
        """q: [Tp, heads, head_dim], the prefill tokens packed -> out (same shape)."""

    def forward(
        self, layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: M
    ) -> torch.Tensor:
        """q: [T, heads, head_dim], k/v: [T, kv_heads, head_dim] -> [T, heads, head_dim]."""
        self.write_kv(layer, k, v, meta)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        d = meta.num_decode
        if d > 0:
            self.decode(layer, q[:d], meta, out[:d])
        if d < q.shape[0]:
            self.prefill(layer, q[d:], meta, out[d:])
        return out


@dataclass(slots=True)
class StepAttention:
    """The step's backend and its metadata, as the layers find them."""

    backend: AttentionBackend[Any]
    metadata: Any


_CONTEXT: StepAttention | None = None


@contextmanager
def forward_context(backend: AttentionBackend[Any], metadata: Any) -> Iterator[None]:
    """Installs the step's attention backend and metadata for one forward."""
    global _CONTEXT
    previous, _CONTEXT = _CONTEXT, StepAttention(backend, metadata)
    try:
        yield
    finally:
        _CONTEXT = previous


def get_context() -> StepAttention:
    if _CONTEXT is None:
        raise RuntimeError("attention called outside forward_context()")
    return _CONTEXT
