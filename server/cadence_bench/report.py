"""The result as `vllm bench serve` prints it (a table), and as JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cadence_bench import machine
from cadence_bench.metrics import LATENCIES, PERCENTILES

TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


def table(result: dict[str, Any]) -> str:
    rows = [
        ("Successful requests", result["completed"]),
        ("Failed requests", result["failed"]),
        ("Benchmark duration (s)", result["duration_s"]),
        ("Total input tokens", result["total_input_tokens"]),
        ("Total generated tokens", result["total_output_tokens"]),
        ("Request throughput (req/s)", result["request_throughput"]),
        ("Output token throughput (tok/s)", result["output_throughput"]),
        ("Total token throughput (tok/s)", result["total_token_throughput"]),
    ]
    lines = ["{:=^60}".format(" Serving Benchmark Result ")]
    lines += [f"{k:<26}{v:>34}" for k, v in machine.rows(result)]
    lines += [_row(k, v) for k, v in rows]
    for name in LATENCIES:
        lines.append("{:-^60}".format(f" {TITLES[name]} "))
        upper = name.upper()
        lines.append(_row(f"Mean {upper} (ms)", result[f"mean_{name}_ms"]))
        lines.append(_row(f"Median {upper} (ms)", result[f"median_{name}_ms"]))
        for p in PERCENTILES[1:]:
            lines.append(_row(f"P{p} {upper} (ms)", result[f"p{p}_{name}_ms"]))
    lines += _step_rows(result.get("steps", {}))
    lines.append("=" * 60)
    return "\n".join(lines)


def _step_rows(steps: dict[str, float]) -> list[str]:
    """cadence's steps over the run (its /metrics), where the server has them."""
    if not steps.get("steps"):
        return []
    lines = ["{:-^60}".format(" Steps (the server's /metrics) ")]
    lines.append(_row("Steps", int(steps["steps"])))
    lines.append(_row("Mean step, start to answer (ms)", steps["mean_step_ms"]))
    lines.append(_row("Mean forward and sampling (ms)", steps["mean_forward_ms"]))
    for key, label in (
        ("outside_forward_of_steps", "Outside the forward, of steps (%)"),
        ("outside_forward_of_run", "Outside the forward, of the run (%)"),
    ):
        if key in steps:
            lines.append(_row(label, 100.0 * steps[key]))
    return lines


def _row(label: str, value: float | int) -> str:
    text = f"{value:.2f}" if isinstance(value, float) else str(value)
    return f"{label:<44}{text:>16}"


def save_json(result: dict[str, Any], path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2) + "\n")
