"""E3/E4's KV accounting against answers worked by hand."""

from __future__ import annotations

import pytest
from cadence_bench.kv import (
    InFlight,
    blocks_for,
    contiguous_slots,
    contiguous_utilization,
    largest_fitting_batch,
    parse_metrics,
    running_at,
    shared_sampling_blocks,
    stored_tokens,
)


def test_parse_metrics_sums_label_sets_and_skips_comments() -> None:
    text = (
        "# HELP cadence_kv_blocks_used blocks\n"
        "# TYPE cadence_kv_blocks_used gauge\n"
        'cadence_kv_blocks_used{model="m"} 12\n'
        'cadence_kv_utilization{model="m"} 0.75\n'
        'cadence_preemptions_total{model="m",kind="recompute"} 3\n'
        'cadence_preemptions_total{model="m",kind="swap"} 2\n'
    )
    m = parse_metrics(text)
    assert m["cadence_kv_blocks_used"] == 12
    assert m["cadence_kv_utilization"] == pytest.approx(0.75)
    assert m["cadence_preemptions_total"] == 5


def test_blocks_and_largest_fitting_batch() -> None:
    assert (blocks_for(16, 16), blocks_for(17, 16), blocks_for(1, 16)) == (1, 2, 1)
    # 32 + 16 = 48 tokens = 3 blocks of 16; 20 blocks hold 6 such requests (18 blocks).
    assert largest_fitting_batch(20, 32, 16, 16) == 6
    # 33 + 16 = 49 tokens = 4 blocks; 20 blocks hold 5.
    assert largest_fitting_batch(20, 33, 16, 16) == 5


def test_contiguous_reservation() -> None:
    # A: prompt 10, may make 30, made 5. B: prompt 20, may make 10, made 10.
    running = [InFlight(10, 30, 5), InFlight(20, 10, 10)]
    assert contiguous_slots(running) == 70  # (10 + 30) + (20 + 10)
    assert stored_tokens(running) == 45  # (10 + 5) + (20 + 10)
    assert contiguous_utilization(running) == pytest.approx(45 / 70)
    assert contiguous_utilization([]) == 0.0


def test_shared_sampling_blocks() -> None:
    # Prompt 40 tokens (2 full blocks + 8), 16 generated: 56 tokens = 4 blocks per sample.
    # Shared: 2 prompt blocks once + 4 samples x 2 own blocks = 10; unshared: 4 x 4 = 16.
    assert shared_sampling_blocks(40, 16, 4, 16) == (10, 16)
    # n = 1: no sharing to gain.
    assert shared_sampling_blocks(40, 16, 1, 16) == (4, 4)


def test_running_at_counts_tokens_received() -> None:
    # Sent at t=100. A: prompt 10, max 4, tokens at 100.5, 100.7, 101.0 (last).
    # B: prompt 20, max 2, tokens at 100.2, 100.4 (last).
    timings = [(10, 4, 0.5, [0.2, 0.3], 1.0), (20, 2, 0.2, [0.2], 0.4)]
    assert running_at(100.1, 100.0, timings) == []  # nothing prefilled yet
    assert running_at(100.3, 100.0, timings) == [InFlight(20, 2, 1)]
    assert running_at(100.6, 100.0, timings) == [InFlight(10, 4, 1)]  # B finished at 100.4
    assert running_at(100.8, 100.0, timings) == [InFlight(10, 4, 2)]
    assert running_at(101.0, 100.0, timings) == []
