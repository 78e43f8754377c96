"""The paged KV cache: one tensor `[layers, 2, num_blocks, block_size, kv_heads,
head_dim]` on the device, sized from a byte budget, plus a host pool of the same block
shape for swap-out/swap-in. Block copies (copy-on-write) and swaps are single indexed
copies over every layer at once.

A quantized cache (`cadence.kv_format`) holds its scales beside the blocks: int8's per
(token, KV head) scales as `token_scales [layers, 2, num_blocks, block_size, kv_heads]`,
copied and swapped with their blocks; fp8's per-layer scales as `layer_scales [layers,
2, 1]`, fixed for the cache's life, so a block means the same wherever it moves."""

from __future__ import annotations

import torch

from cadence import huge_pages
from cadence.kv_format import KVFormat, kv_format


def _zeros(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, huge: bool
) -> torch.Tensor:
    """A pool tensor of zeros; on CPU where `huge`, on 2 MB pages (`cadence.huge_pages`): a
    step reads its blocks scattered over the whole pool."""
    if huge and torch.device(device).type == "cpu":
        return huge_pages.zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def _format(fmt: KVFormat | torch.dtype) -> KVFormat:
    return fmt if isinstance(fmt, KVFormat) else kv_format(str(fmt).removeprefix("torch."))


def bytes_per_block(
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    fmt: KVFormat | torch.dtype,
) -> int:
    """Bytes one block takes over all layers, keys and values, scales included."""
    fmt = _format(fmt)
    per_head = head_dim * fmt.storage.itemsize + fmt.scale_bytes_per_token_head()
    return num_layers * 2 * block_size * num_kv_heads * per_head


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        fmt: KVFormat | torch.dtype,
        device: torch.device | str,
        layer_scales: torch.Tensor | None = None,
        on_huge_pages: bool = False,
    ) -> None:
        """`layer_scales` [layers, 2] float32: an fp8 cache's key and value scales (1.0
        when not given); `on_huge_pages`: the pool on 2 MB pages (CPU only)."""
        self.format = fmt = _format(fmt)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.block_shape = (block_size, num_kv_heads, head_dim)
        self.bytes_per_block = bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, fmt)
        # zeros, not empty: padded block-table entries are read (then masked), and
        # masked garbage that happens to be NaN would poison the attention output.
        shape = (num_layers, 2, num_blocks, *self.block_shape)
        self.blocks = _zeros(shape, fmt.storage, device, on_huge_pages)
        self.host = torch.empty(num_layers, 2, 0, *self.block_shape, dtype=fmt.storage)
        self.token_scales: torch.Tensor | None = None
        self.host_scales: torch.Tensor | None = None
        if fmt.scales == "token":
            shape = (num_layers, 2, num_blocks, block_size, num_kv_heads)
            self.token_scales = _zeros(shape, torch.float32, device, on_huge_pages)
            self.host_scales = torch.empty(*shape[:2], 0, *shape[3:], dtype=torch.float32)
        self.layer_scales: torch.Tensor | None = None
        if fmt.scales == "layer":
            given = torch.ones(num_layers, 2) if layer_scales is None else layer_scales
            self.layer_scales = given.reshape(num_layers, 2, 1).to(torch.float32).to(device)

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) of one layer, each `[num_blocks, block_size, kv_heads, head_dim]`."""
        return self.blocks[index, 0], self.blocks[index, 1]

    def scales(self, index: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(key scales, value scales) of one layer: int8's `[num_blocks, block_size,
        kv_heads]`, fp8's one-element `[1]`, (None, None) for a float cache."""
        held = self.token_scales if self.token_scales is not None else self.layer_scales
        if held is None:
            return None, None
        return held[index, 0], held[index, 1]

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Device block src[i] -> device block dst[i] (copy-on-write)."""
        if src:
            s, d = self._index(src), self._index(dst)
            self.blocks[:, :, d] = self.blocks[:, :, s]
            if self.token_scales is not None:
                self.token_scales[:, :, d] = self.token_scales[:, :, s]

    def swap_out(self, src: list[int], dst: list[int]) -> None:
        """Device block src[i] -> host block dst[i]; the host pool grows as needed."""
        if not src:
            return
        self._grow_host(max(dst) + 1)
        s, d = self._index(src), torch.tensor(dst, dtype=torch.long)
        self.host[:, :, d] = self.blocks[:, :, s].to("cpu")
        if self.token_scales is not None:
            assert self.host_scales is not None
            self.host_scales[:, :, d] = self.token_scales[:, :, s].to("cpu")

    def swap_in(self, src: list[int], dst: list[int]) -> None:
        """Host block src[i] -> device block dst[i]."""
        if not src:
            return
        if max(src) >= self.host.shape[2]:
            raise IndexError(f"host block {max(src)} was never swapped out")
        s, d = torch.tensor(src, dtype=torch.long), self._index(dst)
        device = self.blocks.device
        self.blocks[:, :, d] = self.host[:, :, s].to(device, non_blocking=True)
        if self.token_scales is not None:
            assert self.host_scales is not None
            self.token_scales[:, :, d] = self.host_scales[:, :, s].to(device, non_blocking=True)

    def _index(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long, device=self.blocks.device)

    def _grow_host(self, num_blocks: int) -> None:
        have = self.host.shape[2]
        if num_blocks <= have:
            return
        size = max(num_blocks, 2 * have)
        self.host = self._grown(self.host, size)
        if self.host_scales is not None:
            self.host_scales = self._grown(self.host_scales, size)

    def _grown(self, pool: torch.Tensor, size: int) -> torch.Tensor:
        """`pool` [layers, 2, blocks, ...] with room for `size` blocks, its blocks kept."""
        pin = self.blocks.is_cuda
        grown = torch.zeros(
            *pool.shape[:2], size, *pool.shape[3:], dtype=pool.dtype, pin_memory=pin
        )
        grown[:, :, : pool.shape[2]] = pool
        return grown
