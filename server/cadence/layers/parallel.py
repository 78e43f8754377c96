"""Tensor-parallel rank and size, read from torch.distributed when it is initialized."""

from __future__ import annotations

import torch.distributed as dist


def tp_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def tp_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


def balanced_split(n: int, size: int, rank: int) -> tuple[int, int]:
    """(start, count) of `rank`'s share of `n` items over `size` ranks; the first
    n % size ranks take one more (9 heads over 2 ranks: 5 and 4)."""
    base, extra = divmod(n, size)
    return rank * base + min(rank, extra), base + (rank < extra)
