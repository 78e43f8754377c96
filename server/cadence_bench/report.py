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
    lines.append("=" * 60)
    return "\n".join(lines)


def _row(label: str, value: float | int) -> str:
    text = f"{value:.2f}" if isinstance(value, float) else str(value)
    return f"{label:<44}{text:>16}"


def save_json(result: dict[str, Any], path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2) + "\n")
