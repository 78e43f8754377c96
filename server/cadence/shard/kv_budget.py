"""How many bytes a shard's KV cache gets when --kv-cache-memory is unset: arithmetic over
memory readings that `cadence.shard.memory` takes, so it can be checked with numbers.

--memory-fraction means one thing per device:

- CUDA, as vLLM's `gpu_memory_utilization`: the share of the device's TOTAL memory this
  shard may use in all: its weights, the profiled step's activations, what CUDA allocates
  outside torch (cuBLAS workspaces, NCCL buffers, kernel images) and the KV cache, which
  gets the rest. What other processes use is not this shard's to spend: when they hold
  more than (1 - fraction) of the device, nothing is sized and the error says so.
- CPU: the share of MemAvailable read at warm-up (the loaded weights are already out of
  it), split between the ranks sharing the host; the activations come out of that share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# A mid-size model fits a GPU at 0.9 as in vLLM; on CPU the host serves much else too.
DEFAULT_FRACTION = {"cuda": 0.9, "cpu": 0.1}
GiB = 1 << 30


def default_fraction(device_type: str) -> float:
    """--memory-fraction when it is unset, by device type ("cuda", "cpu")."""
    return DEFAULT_FRACTION.get(device_type, DEFAULT_FRACTION["cpu"])


def cpu_kv_budget(available: int, fraction: float, activation: int, world_size: int = 1) -> int:
    """KV bytes on CPU: `fraction` of `available` (MemAvailable) split between
    `world_size` ranks, less the profiled step's `activation` bytes; may be negative."""
    return int(fraction * (available // world_size)) - activation


@dataclass(frozen=True, slots=True)
class CudaReading:
    """One reading of a device's memory: `torch.cuda.mem_get_info` and the bytes torch's
    caching allocator holds (`torch.cuda.memory_reserved`)."""

    total: int
    free: int
    torch_reserved: int

    @property
    def outside_torch(self) -> int:
        """Used on the device but not through torch's allocator: other processes, this
        process's CUDA context, cuBLAS workspaces, NCCL buffers."""
        return self.total - self.free - self.torch_reserved


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


@dataclass(frozen=True, slots=True)
class CudaBudget:
    """The CUDA accounting: what --memory-fraction allows and what the shard uses of it."""

    fraction: float
    total: int  # the device's memory
    in_use_at_start: int  # before the weights: other processes and this CUDA context
    torch_peak: int  # most torch reserved in the profiled step: weights + activations
    cuda_own: int  # what CUDA allocated outside torch since the start

    @classmethod
    def measure(
        cls, fraction: float, start: CudaReading, after: CudaReading, torch_peak: int
    ) -> CudaBudget:
        """From a reading before the model loaded (`start`), one after the profiled step
        (`after`), and torch's peak reserved bytes during that step, the scratch KV cache
        it ran on left out."""
        return cls(
            fraction=fraction,
            total=start.total,
            in_use_at_start=start.total - start.free,
            torch_peak=torch_peak,
            cuda_own=max(0, after.outside_torch - start.outside_torch),
        )

    @property
    def allowed(self) -> int:
        """What this shard may use in all."""
        return int(self.fraction * self.total)

    @property
    def kv_bytes(self) -> int:
        """The KV cache's bytes: the allowance less what the shard uses besides (may be
        negative)."""
        return self.allowed - self.torch_peak - self.cuda_own

    def problem(self, bytes_per_block: int) -> str | None:
        """Why no KV cache can be sized, with what was measured and the flag to change;
        None when at least one block fits."""
        free_at_start = self.total - self.in_use_at_start
        if free_at_start < self.allowed:
            fits = math.floor(100 * free_at_start / self.total) / 100  # rounded down: it fits
            return (
                f"--memory-fraction {self.fraction} lets this shard use {_gib(self.allowed)} "
                f"of the device's {_gib(self.total)}, but {_gib(self.in_use_at_start)} were "
                f"already in use before it loaded its weights (other processes, and its own "
                f"CUDA context), leaving {_gib(free_at_start)}: lower --memory-fraction to "
                f"{fits:.2f} or less, or free the device"
            )
        if self.kv_bytes < bytes_per_block:
            return (
                f"no room for the KV cache: --memory-fraction {self.fraction} of the "
                f"device's {_gib(self.total)} is {_gib(self.allowed)}, and this shard uses "
                f"{_gib(self.torch_peak)} through torch (weights and the profiled step's "
                f"activations) and {_gib(self.cuda_own)} outside it, leaving "
                f"{_gib(self.kv_bytes)}, less than one {bytes_per_block}-byte block: raise "
                f"--memory-fraction, lower --max-batch-tokens or --max-batch-size (a smaller "
                f"profiled step), or set --kv-cache-memory"
            )
        return None

    def summary(self) -> str:
        """One log line of the accounting."""
        return (
            f"memory: {self.fraction} of {_gib(self.total)} = {_gib(self.allowed)} for this "
            f"shard ({_gib(self.in_use_at_start)} in use before it); torch peak "
            f"{_gib(self.torch_peak)}, CUDA outside torch {_gib(self.cuda_own)}, KV cache "
            f"{_gib(max(0, self.kv_bytes))}"
        )
