"""docs/experiments/E5.md and E5-throughput.png, rendered from E5's records alone."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

from cadence_bench.e5_arithmetic import (  # noqa: E402
    GOAL_MIN_ADAPTERS,
    GOAL_SHARE,
    goal_checks,
    ratio,
)
from cadence_bench.e5_records import E5Records, ServedRun  # noqa: E402

PLOT = "E5-throughput.png"
COLUMNS = (
    "adapters N",
    "adapters used",
    "output tok/s",
    "÷ base",
    "TTFT p50 / p99 ms",
    "ITL p50 / p99 ms",
    "merged tok/s (switch = launch)",
    "merged tok/s (switch = weights read)",
    "merged tok/s, run for real",
    "LoRA ÷ merged",
)


def _latency(result: dict[str, float], name: str) -> str:
    return f"{result[f'median_{name}_ms']:.1f} / {result[f'p99_{name}_ms']:.1f}"


def _row(records: E5Records, run: ServedRun) -> list[str]:
    if run.num_adapters == 0:
        cells = ["base (no adapter)", "-"]
    else:
        cells = [str(run.num_adapters), str(len(run.counts))]
    if run.error:
        cells += [f"did not run: {run.error}", "-", "-", "-"]
    else:
        cells += [
            f"{run.tok_s:.1f}",
            f"{records.share_of_base(run):.2f}",
            _latency(run.result, "ttft"),
            _latency(run.result, "itl"),
        ]
    if run.num_adapters == 0:
        return cells + ["-"] * 4
    merged = records.merged(run, records.switch_s)
    lower = records.merged(run, records.weights_read_s)
    real = records.real_for(run.num_adapters)
    cells += [
        f"{merged.output_throughput:.1f}",
        f"{lower.output_throughput:.1f}",
        f"{real.tok_s:.1f}" if real else "-",
        f"{ratio(run.tok_s, merged.output_throughput):.2f}" if not run.error else "-",
    ]
    return cells


def table(records: E5Records) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for run in [records.base, *records.lora]:
        lines.append("| " + " | ".join(_row(records, run)) + " |")
    return "\n".join(lines)


def shares_table(records: E5Records) -> str:
    lines = [
        "| requests on the copy | wall s | output tokens | output tok/s |",
        "|---|---|---|---|",
    ]
    for k, s in sorted(records.shares.items()):
        tok_s = s.output_tokens / s.duration_s if s.duration_s > 0 else 0.0
        lines.append(f"| {k} | {s.duration_s:.2f} | {s.output_tokens} | {tok_s:.1f} |")
    return "\n".join(lines)


def plot(records: E5Records, path: Path) -> None:
    ns = [r.num_adapters for r in records.lora]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    ax = axes[0]
    ran = [r for r in records.lora if not r.error]
    if ran:
        ax.plot([r.num_adapters for r in ran], [r.tok_s for r in ran], "o-", label="LoRA")
    merged = [records.merged(r, records.switch_s).output_throughput for r in records.lora]
    lower = [records.merged(r, records.weights_read_s).output_throughput for r in records.lora]
    ax.plot(ns, merged, "s--", label="merged copies (switch = launch)")
    ax.plot(ns, lower, "s:", label="merged copies (switch = weights read)")
    real = [records.real_for(n) for n in ns]
    pairs = [(n, r.tok_s) for n, r in zip(ns, real, strict=True) if r]
    if pairs:
        ax.plot(*zip(*pairs, strict=True), "kx", markersize=9, label="merged, run for real")
    base = records.base.tok_s
    ax.axhline(base, color="grey", label="base model")
    ax.axhline(GOAL_SHARE * base, color="grey", ls="--", lw=0.8, label=f"{GOAL_SHARE:.0%} of base")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("distinct adapters in the workload (N)")
    ax.set_title("output tokens/s")
    ax.legend(fontsize=8)
    ax = axes[1]
    for name, label in (("ttft", "TTFT"), ("itl", "ITL")):
        for stat, style in (("median", "o-"), ("p99", "^--")):
            key = f"{stat}_{name}_ms"
            if ran:
                ax.plot(
                    [r.num_adapters for r in ran],
                    [r.result[key] for r in ran],
                    style,
                    label=f"LoRA {label} {'p50' if stat == 'median' else stat}",
                )
            if records.base.result:
                ax.axhline(records.base.result[key], color="grey", lw=0.5)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("distinct adapters in the workload (N)")
    ax.set_title("latency (ms); grey: the base model's")
    if ran:
        ax.legend(fontsize=8)
    fig.suptitle("E5: LoRA serving against the base model and merged copies")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def summary(records: E5Records) -> str:
    base = records.base.tok_s
    ran = {r.num_adapters: r.tok_s for r in records.lora if not r.error}
    if not ran:
        return (
            f"Computed from the table: the base model served {base:.1f} output tok/s; LoRA "
            "serving did not run, so the goal (LoRA ≥ "
            f"{GOAL_SHARE:.0%} of the base model's throughput with {GOAL_MIN_ADAPTERS}+ "
            "adapters) is not yet measured.\n"
        )
    checks = goal_checks(ran, base)
    verdicts = ", ".join(
        f"N={c.num_adapters}: {c.share_of_base:.2f}× ({'met' if c.met else 'not met'})"
        for c in checks
    )
    text = f"Computed from the table: the base model served {base:.1f} output tok/s. "
    text += "LoRA's share of it by adapter count: " + ", ".join(
        f"N={n}: {ratio(v, base):.2f}×" for n, v in sorted(ran.items())
    )
    text += ". Goal (≥ {:.0%} of base with {}+ adapters): {}.\n".format(
        GOAL_SHARE, GOAL_MIN_ADAPTERS, verdicts or f"no run with {GOAL_MIN_ADAPTERS}+ adapters"
    )
    return text


def probes_text(records: E5Records) -> str:
    if not records.probes:
        return ""
    lines = [
        "\nGreedy continuation of one probe prompt (16 tokens), as each server gave it (an "
        "adapter applied by LoRA serving gives its merged copy's text, up to rounding, and "
        "not the base model's):\n"
    ]
    lines += [f"- {label}: {text!r}" for label, text in records.probes.items()]
    return "\n".join(lines) + "\n"
