"""The paged KV cache: one tensor `[layers, 2, num_blocks, block_size, kv_heads,
head_dim]` on the device, sized from a byte budget, plus a host pool of the same block
shape for swap-out/swap-in. Block copies (copy-on-write) and swaps are single indexed
copies over every layer at once."""

from __future__ import annotations

import torch


def bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes one block takes over all layers, keys and values."""
    return num_layers * 2 * block_size * num_kv_heads * head_dim * dtype.itemsize


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.block_shape = (block_size, num_kv_heads, head_dim)
        self.bytes_per_block = bytes_per_block(
            num_layers, block_size, num_kv_heads, head_dim, dtype
        )
        # zeros, not empty: padded block-table entries are read (then masked), and
        # masked garbage that happens to be NaN would poison the attention output.
        self.blocks = torch.zeros(
            num_layers, 2, num_blocks, *self.block_shape, dtype=dtype, device=device
        )
        self.host = torch.empty(num_layers, 2, 0, *self.block_shape, dtype=dtype)

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) of one layer, each `[num_blocks, block_size, kv_heads, head_dim]`."""
        return self.blocks[index, 0], self.blocks[index, 1]

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Device block src[i] -> device block dst[i] (copy-on-write)."""
        if src:
            s, d = self._index(src), self._index(dst)
            self.blocks[:, :, d] = self.blocks[:, :, s]

    def swap_out(self, src: list[int], dst: list[int]) -> None:
        """Device block src[i] -> host block dst[i]; the host pool grows as needed."""
        if not src:
            return
        self._grow_host(max(dst) + 1)
        moved = self.blocks[:, :, self._index(src)].to("cpu")
        self.host[:, :, torch.tensor(dst, dtype=torch.long)] = moved

    def swap_in(self, src: list[int], dst: list[int]) -> None:
        """Host block src[i] -> device block dst[i]."""
        if not src:
            return
        if max(src) >= self.host.shape[2]:
            raise IndexError(f"host block {max(src)} was never swapped out")
        moved = self.host[:, :, torch.tensor(src, dtype=torch.long)]
        self.blocks[:, :, self._index(dst)] = moved.to(self.blocks.device, non_blocking=True)

    def _index(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long, device=self.blocks.device)

    def _grow_host(self, num_blocks: int) -> None:
        have = self.host.shape[2]
        if num_blocks <= have:
            return
        size = max(num_blocks, 2 * have)
        pin = self.blocks.is_cuda
        host = torch.zeros(
            *self.host.shape[:2], size, *self.block_shape, dtype=self.host.dtype, pin_memory=pin
        )
        host[:, :, :have] = self.host
        self.host = host
