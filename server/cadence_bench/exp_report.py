"""The markdown pieces every experiment's report is made of: the header naming the
machine and the command, tables rendered from records (the configurations not yet
measured listed as such), and the router's step trace per configuration."""

from __future__ import annotations

import math
import os
import platform
import shlex
import sys
import time
from collections.abc import Sequence
from typing import Any

from cadence_bench.exp_records import Record
from cadence_bench.step_trace import TRACE_COLUMNS

LATENCY_COLUMNS = [
    ("output tok/s", "output_throughput"),
    ("req/s", "request_throughput"),
    ("mean TTFT ms", "mean_ttft_ms"),
    ("mean TPOT ms", "mean_tpot_ms"),
    ("median E2E ms", "median_e2el_ms"),
    ("p99 E2E ms", "p99_e2el_ms"),
]


def rate_label(rate: float) -> str:
    return "all at once" if math.isinf(rate) else f"Poisson {rate:.3g}/s"


def cpu_class() -> str:
    """The CPU's model name and the instruction sets cadence's kernels can use on it."""
    from cadence import cpu_isa as isa

    return f"{isa.cpu_model()}: {', '.join(isa.supported())}"


def cpus() -> int:
    return os.cpu_count() or 0


def command(name: str, scale: str, server_args: list[str], extra: Sequence[str] = ()) -> str:
    cmd = f"cadence bench experiment {name} --scale {scale}"
    if extra:
        cmd += " " + " ".join(extra)
    if server_args:
        cmd += f" --server-args {shlex.quote(' '.join(server_args))}"
    return cmd


def header(
    name: str,
    title: str,
    scale: str,
    server_args: list[str],
    records: Sequence[Record] = (),
    extra: Sequence[str] = (),
) -> str:
    """The title, the command, the machine; with records, when they were measured."""
    when = time.strftime("%Y-%m-%d")
    stamps = sorted(r.measured_at for r in records if r.measured_at)
    if stamps:
        when = (
            stamps[0][:10]
            if stamps[0][:10] == stamps[-1][:10]
            else f"{stamps[0][:10]} to {stamps[-1][:10]}"
        )
    return (
        f"# {name}: {title}\n\n"
        f"Made by `{command(name, scale, server_args, extra)}` on {when}, "
        f"{platform.machine()}, {cpus()} CPUs ({cpu_class()}), Python "
        f"{sys.version.split()[0]}; SmolLM2-135M-Instruct unless the server arguments say "
        "otherwise. Greedy decoding with EOS ignored, so every configuration generates "
        "exactly the same number of tokens.\n\n"
    )


def _cell(value: Any) -> str:
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def table(
    records: Sequence[Record],
    keys: Sequence[str],
    metrics: Sequence[tuple[str, str]] = LATENCY_COLUMNS,
) -> str:
    """One row per record: its config's `keys`, then the result's `metrics`."""
    head = "| " + " | ".join([*keys, *(label for label, _ in metrics)]) + " |"
    lines = [head, "|" + "---|" * (len(keys) + len(metrics))]
    for r in records:
        cells = [_cell(r.config.get(k, "")) for k in keys]
        cells += [f"{float(r.result.get(m, 0.0)):.1f}" for _, m in metrics]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def trace_table(records: Sequence[Record], keys: Sequence[str]) -> str:
    """The router's step trace of each record: steps, time per step, tokens and
    requests per step, preemptions (deltas of /metrics over the measured run)."""
    head = "| " + " | ".join([*keys, *(label for label, _ in TRACE_COLUMNS)]) + " |"
    lines = [head, "|" + "---|" * (len(keys) + len(TRACE_COLUMNS))]
    for r in records:
        cells = [_cell(r.config.get(k, "")) for k in keys]
        for _, key in TRACE_COLUMNS:
            value = float(r.trace.get(key, 0.0))
            cells.append(f"{value:.0f}" if key in ("steps", "preemptions") else f"{value:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


TRACE_NOTE = (
    "Step trace: the router's /metrics read before and after each measured run; `steps` "
    "is the `cadence_step_duration_seconds` count, `mean step ms` its sum ÷ count (a step "
    "from its send, or from the previous step's answer when it was sent ahead, to its "
    "answer), `mean forward ms` the same of "
    "`cadence_forward_duration_seconds` (the shard's forward and sampling), `tokens/step` "
    "`cadence_step_tokens_total` ÷ steps (prefill and decode tokens computed), "
    "`requests/step` the `cadence_batch_size` mean, `preemptions` the "
    "`cadence_preemptions_total` delta.\n\n"
)


def missing(labels: Sequence[str]) -> str:
    """The configurations with no record yet, as a paragraph (empty when none)."""
    if not labels:
        return ""
    return (
        "\nNot measured yet (no record with this command's settings): "
        + "; ".join(labels)
        + ". Run the same command again to measure them.\n"
    )
