"""E5's arithmetic (the merged-copy baseline composed from share times, ratios, the goal),
its progress kept between runs (resume, one configuration at a time), and its document
and plot rendered from records, without measuring anything."""

from __future__ import annotations

from pathlib import Path

import pytest
from cadence_bench import e5_progress
from cadence_bench.e5_arithmetic import (
    GoalCheck,
    ShareTime,
    compose_merged,
    goal_checks,
    ratio,
    share_sizes,
)
from cadence_bench.e5_records import E5Records, RealMerged, ServedRun, from_json, to_json
from cadence_bench.e5_report import plot, summary, table
from cadence_bench.lora_experiment import document, records_from

SHARES = {
    1: ShareTime(1, 2.0, 64),
    2: ShareTime(2, 2.5, 128),
    4: ShareTime(4, 3.0, 256),
}


def test_share_sizes_are_the_distinct_non_zero_counts() -> None:
    assert share_sizes([4, 1, 0, 4, 2, 1]) == [1, 2, 4]
    assert share_sizes([]) == []


def test_merged_baseline_sums_shares_and_one_switch_per_used_copy() -> None:
    est = compose_merged([4, 1, 0, 2, 1], SHARES, switch_s=10.0)
    assert est.output_tokens == 256 + 64 + 128 + 64
    assert est.serving_s == 3.0 + 2.0 + 2.5 + 2.0
    assert est.copies == 4  # the adapter without requests is never loaded
    assert est.total_s == 9.5 + 40.0
    assert est.output_throughput == 512 / 49.5
    free = compose_merged([4, 1, 0, 2, 1], SHARES, switch_s=0.0)
    assert free.output_throughput == 512 / 9.5


def test_merged_baseline_needs_every_share_size_measured() -> None:
    with pytest.raises(ValueError, match=r"\[3\]"):
        compose_merged([1, 3], SHARES, 1.0)


def test_ratio_and_goal() -> None:
    assert ratio(80.0, 100.0) == 0.8
    assert ratio(5.0, 0.0) == 0.0
    checks = goal_checks({1: 99.0, 64: 80.0, 512: 79.0}, 100.0)
    assert checks == [GoalCheck(64, 0.8), GoalCheck(512, 0.79)]
    assert [c.met for c in checks] == [True, False]


def _result(tok_s: float, ttft: float, itl: float) -> dict[str, float]:
    return {
        "output_throughput": tok_s,
        "median_ttft_ms": ttft,
        "p99_ttft_ms": 2 * ttft,
        "median_itl_ms": itl,
        "p99_itl_ms": 3 * itl,
        "completed": 8,
    }


def _records(lora_ran: bool) -> E5Records:
    lora = [
        ServedRun(1, {"adapter-0000": 8}, _result(90.0, 50.0, 10.0)),
        ServedRun(
            64, {"adapter-0003": 2, "adapter-0007": 4, "adapter-0009": 2}, _result(85.0, 60, 12)
        ),
    ]
    if not lora_ran:
        for run in lora:
            run.result, run.error = {}, "cadence launch: error: unrecognized arguments"
    return E5Records(
        plan={
            "model": "/m",
            "adapters_dir": "/a",
            "num_prompts": 8,
            "input_len": 64,
            "output_len": 64,
            "concurrency": 32,
        },
        machine="x86_64, 2 CPUs (test)",
        base=ServedRun(0, result=_result(100.0, 40.0, 9.0)),
        lora=lora,
        shares={2: ShareTime(2, 2.0, 128), 4: ShareTime(4, 3.0, 256), 8: ShareTime(8, 5, 512)},
        switch_s=10.0,
        weights_read_s=0.5,
        real=[RealMerged(1, 512, 16.0, 11.0)],
        probes={"base model": " the wind", "merged copy of adapter-0000": " the tide"},
        load_average=(1.0, 2.0),
    )


def test_table_rows_from_records() -> None:
    records = _records(lora_ran=True)
    lines = table(records).splitlines()
    assert lines[2].startswith(
        "| base (no adapter) | - | 100.0 | 1.00 | 40.0 / 80.0 | 9.0 / 27.0 |"
    )
    # N=1: 8 requests on one copy: 512 tokens in 5 s + one 10 s switch (or 0.5 s).
    assert lines[3] == (
        "| 1 | 1 | 90.0 | 0.90 | 50.0 / 100.0 | 10.0 / 30.0 | 34.1 | 93.1 | 32.0 | 2.64 |"
    )
    # N=64, three adapters used: shares of 2, 4 and 2 requests, three switches.
    merged = 512 / (2.0 + 3.0 + 2.0 + 30.0)
    lower = 512 / (7.0 + 1.5)
    assert lines[4].split(" | ")[6:9] == [f"{merged:.1f}", f"{lower:.1f}", "-"]
    assert lines[4].endswith(f"| {85.0 / merged:.2f} |")
    assert "goal" in summary(records).lower() and "N=64: 0.85× (met)" in summary(records)


def test_runs_that_did_not_start_still_get_their_merged_baseline() -> None:
    records = _records(lora_ran=False)
    row = table(records).splitlines()[4]
    assert "did not run: cadence launch: error: unrecognized arguments" in row
    assert f"{512 / 37.0:.1f}" in row
    assert "not yet measured" in summary(records)


def test_records_round_trip_and_render(tmp_path: Path) -> None:
    records = _records(lora_ran=True)
    assert from_json(to_json(records)) == records
    plot(records, tmp_path / "E5.png")
    assert (tmp_path / "E5.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plot(_records(lora_ran=False), tmp_path / "E5-none.png")
    text = document(records, "cadence bench experiment E5 --quick")
    assert text.startswith("# E5: LoRA serving as the number of adapters grows")
    assert "`cadence bench experiment E5 --quick`" in text and "x86_64, 2 CPUs (test)" in text
    assert table(records) in text and "' the tide'" in text


PLAN = {
    "adapter_counts": [1, 64],
    "num_prompts": 8,
    "input_len": 64,
    "output_len": 64,
    "concurrency": 32,
    "real_merged_max": 8,
    "model": "/m",
}


def test_progress_names_every_configuration_and_what_is_left() -> None:
    progress = e5_progress.E5Progress(dict(PLAN))
    assert progress.slugs() == ["base", "lora-1", "lora-64", "merged", "real-1"]
    assert progress.missing() == progress.slugs()
    records = _records(lora_ran=True)
    progress.base = records.base
    progress.lora[64] = records.lora[1]
    progress.real[1] = records.real[0]
    assert progress.missing() == ["lora-1", "merged"]


def test_progress_resumes_only_for_the_same_plan(tmp_path: Path) -> None:
    records = _records(lora_ran=True)
    progress = e5_progress.E5Progress(dict(PLAN), base=records.base, probes=records.probes)
    progress.lora = {1: records.lora[0], 64: records.lora[1]}
    progress.merged = e5_progress.MergedShares(records.shares, 10.0, 0.5)
    progress.real = {1: records.real[0]}
    progress.load_start = 1.5
    e5_progress.save(progress, tmp_path)
    # the plan as run_e5 builds it (tuples): the same plan as the file's lists
    again = e5_progress.load(tmp_path, {**PLAN, "adapter_counts": (1, 64)}, fresh=False)
    assert again == progress and again.missing() == []
    assert e5_progress.load(tmp_path, {**PLAN, "num_prompts": 16}, fresh=False).base is None
    assert e5_progress.load(tmp_path, PLAN, fresh=True).missing() == progress.slugs()
    assert not (tmp_path / (e5_progress.PROGRESS_FILE + ".tmp")).exists()


def test_a_complete_progress_renders_the_records(tmp_path: Path) -> None:
    records = _records(lora_ran=True)
    progress = e5_progress.E5Progress(
        {**PLAN, "adapter_counts": [1, 64]}, base=records.base, probes=records.probes
    )
    progress.lora = {64: records.lora[1], 1: records.lora[0]}
    progress.merged = e5_progress.MergedShares(records.shares, 10.0, 0.5)
    progress.real = {1: records.real[0]}
    rendered = records_from(progress, Path("/a"))
    assert [run.num_adapters for run in rendered.lora] == [1, 64]  # the plan's order
    assert rendered.shares == records.shares and rendered.real == records.real
    assert rendered.plan["adapters_dir"] == "/a" and rendered.probes == records.probes
    assert table(rendered) == table(records)
