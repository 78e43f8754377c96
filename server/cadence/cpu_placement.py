"""Where each shard process runs on a CPU host when several share it (`--replicas`): the
cores the launcher may use are split into equal, disjoint sets, one per shard, and each
shard runs as many compute threads as its set has cores. Two shards that each ran a
thread per core of the whole machine would oversubscribe it, and OpenMP stops
spin-waiting then, which slows every step."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    """One shard's cores (pinned) and compute threads."""

    cores: tuple[int, ...]
    threads: int

    def cores_arg(self) -> str:
        return ",".join(map(str, self.cores))


def available_cores() -> list[int]:
    """The cores this process may run on (a container's CPU set, taskset's)."""
    return sorted(os.sched_getaffinity(0))


def plan(num_shards: int, cores: list[int]) -> list[Placement]:
    """Disjoint, equal core sets for `num_shards` shards, in order; with fewer cores
    than shards every shard gets them all and one thread (they time-share)."""
    if num_shards > len(cores):
        return [Placement(tuple(cores), 1) for _ in range(num_shards)]
    per_shard = len(cores) // num_shards
    return [
        Placement(tuple(cores[i * per_shard : (i + 1) * per_shard]), per_shard)
        for i in range(num_shards)
    ]


def parse_cores(text: str) -> list[int]:
    """`0,1,4` -> [0, 1, 4]; empty -> []."""
    return [int(part) for part in text.split(",") if part.strip()]


def pin_this_process(cores: list[int]) -> None:
    """Restricts this process (and the threads it starts later) to `cores`. Called first
    thing in a shard, before torch starts its thread pools."""
    if cores:
        os.sched_setaffinity(0, cores)
