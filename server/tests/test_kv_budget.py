"""The KV cache's size from --memory-fraction: the CUDA accounting (vLLM's meaning: a share
of the device's total memory for everything the shard holds) on measured numbers, and on
CPU the share of MemAvailable, through a real engine's warm-up."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from cadence.config import ShardConfig
from cadence.shard.engine import Engine
from cadence.shard.kv_budget import CudaBudget, CudaReading, cpu_kv_budget, default_fraction
from cadence.shard.memory import available_bytes

GiB = 1 << 30
MiB = 1 << 20
TOTAL = 80 * GiB
BLOCK = 2 * MiB


def _budget(
    fraction: float = 0.9,
    others: int = GiB // 2,
    torch_peak: int = 17 * GiB,
    torch_reserved_after: int = 16 * GiB,
    cuda_own: int = 300 * MiB,
) -> CudaBudget:
    """A device where `others` bytes were in use before the shard started, and readings
    after its profiled step in which CUDA holds `cuda_own` more bytes outside torch."""
    start = CudaReading(total=TOTAL, free=TOTAL - others, torch_reserved=0)
    after_free = TOTAL - others - torch_reserved_after - cuda_own
    after = CudaReading(total=TOTAL, free=after_free, torch_reserved=torch_reserved_after)
    return CudaBudget.measure(fraction, start, after, torch_peak)


def test_the_kv_cache_gets_the_fractions_share_of_total_memory_less_what_the_shard_uses() -> None:
    budget = _budget()
    assert budget.allowed == int(0.9 * 80 * GiB)
    assert budget.cuda_own == 300 * MiB  # the growth outside torch, not torch's cache
    # weights + activations (torch's peak), CUDA's own and the KV cache fill the share once
    assert budget.kv_bytes + 17 * GiB + 300 * MiB == budget.allowed
    assert budget.kv_bytes == 72 * GiB - 17 * GiB - 300 * MiB
    assert budget.problem(BLOCK) is None


def test_other_processes_within_the_rest_of_the_device_do_not_change_the_kv_cache() -> None:
    """The fraction is of the device's total, not of what happened to be free."""
    alone = _budget(others=GiB // 2)
    shared = _budget(others=7 * GiB)  # under the 8 GiB that 0.9 leaves to others
    assert shared.kv_bytes == alone.kv_bytes
    assert shared.problem(BLOCK) is None


def test_torch_caching_between_readings_is_not_counted_as_cudas_own() -> None:
    """Bytes torch keeps cached after the profiled step are torch's: only the growth of
    what is used outside torch's allocator counts as CUDA's own."""
    cached_more = _budget(torch_reserved_after=20 * GiB)
    assert cached_more.cuda_own == _budget().cuda_own == 300 * MiB


def test_other_processes_using_more_than_the_fraction_leaves_are_named_with_the_fix() -> None:
    budget = _budget(fraction=0.9, others=10 * GiB)
    problem = budget.problem(BLOCK)
    assert problem is not None
    assert "10.00 GiB were already in use" in problem, problem
    assert "80.00 GiB" in problem and "--memory-fraction" in problem
    suggested = re.search(r"lower --memory-fraction to ([0-9.]+) or less", problem)
    assert suggested is not None, problem
    # the fraction it suggests is one that works on that device (70 of 80 GiB free)
    assert float(suggested.group(1)) == 0.87
    assert _budget(fraction=0.87, others=10 * GiB).problem(BLOCK) is None


def test_a_model_that_leaves_no_block_says_what_was_measured_and_which_flags_help() -> None:
    budget = _budget(fraction=0.2, torch_peak=16 * GiB)  # 16 GiB allowed, 16.3 used
    assert budget.kv_bytes < 0
    problem = budget.problem(BLOCK)
    assert problem is not None
    for part in ("16.00 GiB", "0.29 GiB outside it", "--memory-fraction", "--kv-cache-memory"):
        assert part in problem, problem
    assert "--max-batch-tokens" in problem
    # a block's worth more of the device fits one
    fits = _budget(fraction=0.2, torch_peak=16 * GiB - 300 * MiB - BLOCK)
    assert fits.problem(BLOCK) is None and fits.kv_bytes >= BLOCK


def test_cpu_budget_is_the_share_of_available_memory_split_between_ranks() -> None:
    assert cpu_kv_budget(8 * GiB, 0.1, 100 * MiB) == int(0.1 * 8 * GiB) - 100 * MiB
    assert cpu_kv_budget(8 * GiB, 0.1, 100 * MiB, world_size=2) == int(0.1 * 4 * GiB) - 100 * MiB
    assert cpu_kv_budget(GiB, 0.01, 100 * MiB) < 0  # the activations do not fit


def test_default_fractions_follow_the_device() -> None:
    assert default_fraction("cuda") == 0.9
    assert default_fraction("cpu") == 0.1


def test_cpu_warmup_sizes_the_kv_cache_from_available_memory(model_dirs) -> None:
    """A real engine on CPU: the KV cache and the profiled activations together take the
    fraction of MemAvailable as read around the warm-up (other processes move it a little)."""
    path: Path = model_dirs("llama_gqa")
    engine = Engine(ShardConfig(model_dir=str(path), uds_path="", dtype="float32"))
    fraction = 0.002
    before = available_bytes(torch.device("cpu"))
    warm = engine.warmup(max_batch_tokens=64, max_batch_size=8, memory_fraction=fraction)
    after = available_bytes(torch.device("cpu")) + warm.kv_cache_bytes  # the cache is zeroed
    used = warm.kv_cache_bytes + warm.activation_bytes
    assert warm.kv_cache_bytes == warm.num_blocks * warm.bytes_per_block
    low, high = sorted((before, after))
    assert fraction * low * 0.95 - warm.bytes_per_block <= used <= fraction * high * 1.05


def test_replicas_sharing_the_machine_split_the_fraction(model_dirs) -> None:
    """Warmed up as one of 2 replicas, a shard takes half the fraction of MemAvailable."""
    path: Path = model_dirs("llama_gqa")
    engine = Engine(ShardConfig(model_dir=str(path), uds_path="", dtype="float32"))
    fraction = 0.004
    before = available_bytes(torch.device("cpu"))
    warm = engine.warmup(64, 8, memory_fraction=fraction, replicas=2)
    after = available_bytes(torch.device("cpu")) + warm.kv_cache_bytes
    used = warm.kv_cache_bytes + warm.activation_bytes
    low, high = sorted((before, after))
    assert fraction / 2 * low * 0.95 - warm.bytes_per_block <= used <= fraction / 2 * high * 1.05


def test_the_shard_answers_the_host_pool_it_holds_for_swaps(model_dirs) -> None:
    """WarmupResponse.host_blocks: 4 × the KV cache's blocks by default, `--swap-blocks` when
    asked, and more than that a warm-up error naming the flag."""
    path: Path = model_dirs("llama_gqa")
    engine = Engine(ShardConfig(model_dir=str(path), uds_path="", dtype="float32"))
    warm = engine.warmup(64, 8, kv_cache_bytes=1 << 20)
    assert warm.host_blocks == 4 * warm.num_blocks
    assert engine.warmup(64, 8, kv_cache_bytes=1 << 20, swap_blocks=7).host_blocks == 7
    with pytest.raises(ValueError, match="--swap-blocks"):
        engine.warmup(64, 8, kv_cache_bytes=1 << 20, swap_blocks=4 * warm.num_blocks + 1)
