"""Memory facts for sizing the KV cache: available memory and peak usage, CPU or CUDA.
The arithmetic over them is `cadence.shard.kv_budget`."""

from __future__ import annotations

from pathlib import Path

import torch

from cadence.shard.kv_budget import CudaReading


def _proc_kib(path: str, key: str) -> int | None:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def available_bytes(device: torch.device) -> int:
    """CUDA: total device memory. CPU: MemAvailable (weights already loaded are not in it)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return _proc_kib("/proc/meminfo", "MemAvailable") or 0


def cuda_reading(device: torch.device) -> CudaReading:
    """The device's total and free memory, and what torch's allocator holds of it."""
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return CudaReading(total=total, free=free, torch_reserved=torch.cuda.memory_reserved(device))


class PeakMeter:
    """Peak memory above the starting point across a block of work. CUDA: the
    allocator's peak. CPU: the process's peak RSS (VmHWM, reset through clear_refs);
    `None` when the kernel does not let us reset it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.start = 0
        self.ok = True

    def __enter__(self) -> PeakMeter:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()  # what loading left cached is not the step's peak
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
            return self
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            self.ok = False
        self.start = _proc_kib("/proc/self/status", "VmRSS") or 0
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def peak(self) -> int | None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - self.start
        hwm = _proc_kib("/proc/self/status", "VmHWM")
        if not self.ok or hwm is None:
            return None
        return max(0, hwm - self.start)

    def torch_reserved_peak(self) -> int:
        """CUDA: the most torch's allocator held across the block (what it held before
        included: the weights). CPU: 0, torch's allocator keeps no such count there."""
        if self.device.type != "cuda":
            return 0
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_reserved(self.device)
