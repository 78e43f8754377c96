"""`cadence bench` against the launched server: a tiny run through each API, checking the
JSON has every metric and the counts add up (EOS ignored, so every token is accounted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cadence_bench.metrics import LATENCIES, PERCENTILES

STATS = ("mean", "median", "std", *(f"p{p}" for p in PERCENTILES))
COUNTS = ("completed", "failed", "total_input_tokens", "total_output_tokens", "duration_s")
THROUGHPUTS = ("request_throughput", "output_throughput", "total_token_throughput")


def _bench(url: str, result: Path, *flags: str) -> tuple[int, str, dict]:
    argv = [sys.executable, "-m", "cadence", "bench", "--base-url", url, "--no-progress"]
    argv += ["--result-file", str(result), *flags]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stdout + proc.stderr, json.loads(result.read_text())


@pytest.mark.parametrize("backend", ["tgi", "openai"])
def test_bench_reports_every_metric_and_the_counts_add_up(
    smollm_server, tmp_path: Path, backend: str
) -> None:
    flags = ["--backend", backend, "--num-prompts", "6", "--input-len", "12:40"]
    flags += ["--output-len", "3:9", "--ignore-eos", "--max-concurrency", "3"]
    flags += ["--request-rate", "50", "--seed", "7"]
    code, out, r = _bench(smollm_server.url, tmp_path / "r.json", *flags)
    assert code == 0, out
    assert "Serving Benchmark Result" in out and "Mean TTFT (ms)" in out
    for key in COUNTS + THROUGHPUTS:
        assert key in r, key
    for name in LATENCIES:
        for stat in STATS:
            assert f"{stat}_{name}_ms" in r, (stat, name)
    assert (r["completed"], r["failed"], r["num_prompts"]) == (6, 0, 6)
    # The same workload rebuilt here: its lengths are what the server must have seen.
    from cadence_bench.datasets import load_tokenizer, random_dataset

    reqs = random_dataset(load_tokenizer(None), 6, (12, 40), (3, 9), seed=7)
    assert r["total_input_tokens"] == sum(q.prompt_len for q in reqs)
    assert r["total_output_tokens"] == sum(q.output_len for q in reqs)
    assert r["output_throughput"] == pytest.approx(r["total_output_tokens"] / r["duration_s"])
    assert 0 < r["median_ttft_ms"] <= r["p99_e2el_ms"]
    # cadence's own step series over the run: every token came from one of its steps
    steps = r["steps"]
    assert steps["steps"] >= max(q.output_len for q in reqs)
    assert 0 < steps["mean_forward_ms"] < steps["mean_step_ms"]
    assert 0 < steps["outside_forward_of_steps"] < steps["outside_forward_of_run"] < 1
    assert "Outside the forward, of the run (%)" in out


def test_bench_counts_failed_requests(smollm_server, tmp_path: Path) -> None:
    # Longer outputs than the model's context: the server answers 422, the bench counts it.
    flags = ["--num-prompts", "2", "--input-len", "8", "--output-len", "100000"]
    code, out, r = _bench(smollm_server.url, tmp_path / "r.json", *flags)
    assert code == 1, out
    assert (r["completed"], r["failed"]) == (0, 2)
    assert any("422" in e for e in r["errors"]), r["errors"]
    assert f"a failed request: {r['errors'][0]}" in out, "why it failed is printed"
