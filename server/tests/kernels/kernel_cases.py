"""Random paged caches with ragged sequences scattered over shuffled blocks."""

from __future__ import annotations

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def paged_cache(
    lens: list[int], block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache, block_tables): every sequence owns distinct random blocks, the
    table padded with an out-of-range-free block 0; spare blocks hold garbage too."""
    g = torch.Generator().manual_seed(seed)
    need = [(n + block_size - 1) // block_size for n in lens]
    num_blocks = sum(need) + 3
    order = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(lens), max(need), dtype=torch.int32)
    used = 0
    for b, k in enumerate(need):
        tables[b, :k] = order[used : used + k]
        used += k
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    return k_cache.to(DEVICE), v_cache.to(DEVICE), tables.to(DEVICE)


def poisoned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An output buffer full of NaN: any element a kernel fails to write fails the test."""
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert not actual.isnan().any(), "unwritten (poisoned) elements in the output"
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


def quantized_cache(
    cache: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A float cache as `dtype` stores it (`cadence.kv_format`), with its scales: int8's per
    slot and KV head, fp8's one for the layer (its largest value maps to a quarter of
    the format's range); a float dtype's cache converted, no scales."""
    from cadence.kv_format import quantize_fp8, quantize_int8

    if dtype == torch.int8:
        return quantize_int8(cache)
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        scale = (cache.abs().max() * 4 / torch.finfo(dtype).max).float().reshape(1)
        return quantize_fp8(cache, scale, dtype), scale
    return cache.to(dtype), None
