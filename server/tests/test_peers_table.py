"""benchmarks/peers/peers_table.py: the table of an alternated sitting and the line that
measures the goal (cadence's default against each other server, per round and over the
rounds, with the rounds where its p99 TTFT was lower), from result files as `cadence
bench --result-file` writes them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "peers" / "peers_table.py"


def result(rate: float, mean_ttft: float, p99_ttft: float, failed: int = 0) -> dict:
    return {
        "output_throughput": rate,
        "mean_ttft_ms": mean_ttft,
        "p99_ttft_ms": p99_ttft,
        "failed": failed,
    }


def table_of(folder: Path, servers: str) -> str:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(folder), servers],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return done.stdout


def write(folder: Path, runs: dict[tuple[int, str], dict]) -> None:
    for (round_, name), value in runs.items():
        (folder / f"round{round_}-{name}.json").write_text(json.dumps(value))


def test_ratio_per_round_and_over_the_rounds(tmp_path: Path) -> None:
    write(
        tmp_path,
        {
            (1, "cadence-default"): result(600.0, 800.0, 2500.0),
            (2, "cadence-default"): result(400.0, 1200.0, 4500.0),
            (1, "vllm-cpu"): result(250.0, 1400.0, 4000.0),
            (2, "vllm-cpu"): result(250.0, 1400.0, 4000.0),
        },
    )
    out = table_of(tmp_path, "cadence-default,vllm-cpu")
    assert "| cadence-default | 600.0 (800 / 2,500) | 400.0 (1,200 / 4,500) |" in out
    # (600 + 400) / (250 + 250) = 2.0 over the rounds, the mean rates beside it; the second
    # round's p99 TTFT is the higher one
    assert (
        "cadence-default against vllm-cpu: 2.400x, 1.600x per round; 2.000x over 2 rounds "
        "(500.0 against 250.0 tok/s); p99 TTFT lower in 1 of 2"
    ) in out


def test_a_round_with_failed_requests_is_left_out_of_the_ratio(tmp_path: Path) -> None:
    write(
        tmp_path,
        {
            (1, "cadence-default"): result(500.0, 800.0, 2500.0),
            (2, "cadence-default"): result(900.0, 700.0, 2000.0),
            (1, "vllm-cpu"): result(200.0, 1400.0, 4000.0),
            (2, "vllm-cpu"): result(100.0, 1400.0, 4000.0, failed=3),
        },
    )
    out = table_of(tmp_path, "cadence-default,vllm-cpu")
    assert "100.0 (1,400 / 4,000), 3 failed" in out  # the table still shows it
    assert (
        "cadence-default against vllm-cpu: 2.500x per round; 2.500x over 1 round "
        "(500.0 against 200.0 tok/s); p99 TTFT lower in 1 of 1"
    ) in out


def test_no_ratio_without_cadence_default(tmp_path: Path) -> None:
    write(tmp_path, {(1, "vllm-cpu"): result(200.0, 1400.0, 4000.0)})
    out = table_of(tmp_path, "vllm-cpu")
    assert "| vllm-cpu | 200.0 (1,400 / 4,000) |" in out
    assert "against" not in out
