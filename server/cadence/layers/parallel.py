"""Tensor-parallel rank and size, read from torch.distributed when it is initialized."""

from __future__ import annotations

import torch
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


def all_reduce_sum(t: torch.Tensor) -> None:
    """Sums `t` over the ranks in place, every element in rank order. With two ranks that is
    the backend's own all-reduce (a + b == b + a exactly). With more, a ring all-reduce
    starts each element's sum at a rank that depends on where the element sits in the
    buffer -- on the step's size -- so the parts are gathered and added in rank order,
    which keeps a row's bits independent of the other rows in its step."""
    size = tp_size()
    if size <= 2:
        dist.all_reduce(t)
        return
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous())
    total = parts[0]
    for part in parts[1:]:
        total += part
    t.copy_(total)
