"""E3's second half: the same machine serving one instance, then 2 and 4 replicas
(`--replicas`) behind one router, each configuration run a few times with fresh prompts
(no prefix-cache carry-over) and the median run kept."""

from __future__ import annotations

import os
import re
from pathlib import Path

import httpx
import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

from cadence_bench.datasets import BenchRequest  # noqa: E402
from cadence_bench.exp_records import Record  # noqa: E402
from cadence_bench.exp_report import LATENCY_COLUMNS, table  # noqa: E402
from cadence_bench.exp_runner import Context, Measured, Planned, measure_requests  # noqa: E402

REPLICAS = (1, 2, 4)
REPLICA_REQUESTS = 64
REPLICA_RUNS = 3  # per replica count, each with fresh prompts


def routed(metrics_text: str) -> str:
    """`cadence_replica_requests_total` per replica, as `a / b / ...` (all of them with
    one replica, which exports no per-replica series)."""
    found = re.findall(
        r'^cadence_replica_requests_total\{[^}]*replica="(\d+)"\} (\S+)$', metrics_text, re.M
    )
    if not found:
        total = re.search(r"^cadence_requests_succeeded_total\{[^}]*\} (\S+)$", metrics_text, re.M)
        return total.group(1) if total else "?"
    return " / ".join(str(int(float(v))) for _, v in sorted(found, key=lambda f: int(f[0])))


def _measure(url: str, runs: list[list[BenchRequest]]) -> Measured:
    measured = sorted(
        (measure_requests(url, requests, float("inf")) for requests in runs),
        key=lambda m: m.result["output_throughput"],
    )
    median = measured[len(measured) // 2]
    low, high = (m.result["output_throughput"] for m in (measured[0], measured[-1]))
    median.columns = {
        "requests per replica": routed(httpx.get(f"{url}/metrics", timeout=30).text),
        "output tok/s, lowest–highest run": f"{low:.1f}–{high:.1f}",
        "low": low,
        "high": high,
    }
    return median


def plan(ctx: Context, runs: list[list[BenchRequest]]) -> list[Planned]:
    items = []
    for n in REPLICAS:

        def measure(url: str) -> Measured:
            return _measure(url, runs)

        items.append(
            Planned(
                slug=f"replicas-{n}",
                label=f"{n} replica{'s' if n > 1 else ''}",
                config={"replicas": n},
                flags=["--replicas", str(n), *ctx.server_args],
                requests=len(runs) * len(runs[0]),
                measure=measure,
                determinants={
                    "prompt_len": runs[0][0].prompt_len,
                    "output_len": runs[0][0].output_len,
                    "requests": len(runs[0]),
                    "runs": len(runs),
                },
            )
        )
    return items


def _plot(rows: list[Record], path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    counts = [str(r.config["replicas"]) for r in rows]
    axes[0].bar(counts, [r.result["output_throughput"] for r in rows])
    axes[0].set_title("output tokens/s, all at once")
    axes[1].bar(counts, [r.result["mean_tpot_ms"] for r in rows])
    axes[1].set_title("mean time per output token (ms)")
    for ax in axes:
        ax.set_xlabel("--replicas")
    fig.suptitle("E3: one instance against replicas")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def section(
    ctx: Context, rows: list[Record], sweep: list[Record], input_len: int, output_len: int
) -> str:
    """E3.md's replicas section from the records present."""
    text = (
        "\n## One instance against replicas\n\n"
        f"{REPLICA_REQUESTS} requests sent at once (prompts of {input_len} tokens, outputs "
        f"of {output_len}) to `cadence launch --replicas N` for N in "
        f"{', '.join(map(str, REPLICAS))}, {REPLICA_RUNS} runs each with fresh prompts (the "
        "table shows the median run and the range): N shard groups behind one router, "
        "which sends each request to the replica holding the fewest requests (then the "
        "least KV in use) unless another caches its prompt prefix. On this machine's "
        f"{len(os.sched_getaffinity(0))} cores the launcher gives each shard its own cores "
        "and as many threads when there are enough cores, and one thread each, "
        "time-sharing all the cores, when there are more shards than cores; the KV memory "
        "is split evenly. `requests per replica` is `cadence_replica_requests_total` after "
        "the runs (the warm-up request included); the step trace below covers all runs.\n\n"
        + table(
            rows,
            ["replicas", "requests per replica", "output tok/s, lowest–highest run"],
            LATENCY_COLUMNS,
        )
    )
    if not rows:
        return text + "\n"
    _plot(rows, ctx.out / "E3-replicas.png")
    base = rows[0].result["output_throughput"]
    ratios = ", ".join(
        f"{r.config['replicas']}: {r.result['output_throughput'] / base:.2f}×" for r in rows
    )
    text += (
        "\n\n![throughput and TPOT against replicas](E3-replicas.png)\n\n"
        f"Computed from the table: output throughput relative to {rows[0].config['replicas']} "
        f"replica(s): {ratios}.\n"
    )
    if len(sweep) >= 2 and rows[0].config["replicas"] == 1:
        text += plateau_reading(sweep, rows)
    return text


def plateau_reading(sweep: list[Record], replica_rows: list[Record]) -> str:
    """The replica runs read against the batch-size sweep: whether the best replica count
    beat one instance beyond the runs' spread, and whether one instance had plateaued."""
    last, before = sweep[-1], sweep[-2]
    growth = last.result["output_throughput"] / before.result["output_throughput"]
    best = max(replica_rows, key=lambda r: r.result["output_throughput"])
    one = replica_rows[0].config
    low, high = best.config["low"] / one["high"], best.config["high"] / one["low"]
    if best is replica_rows[0]:
        verdict = "one instance is the fastest measured"
    elif low <= 1.0:
        verdict = (
            f"the best count, {best.config['replicas']}, is within the runs' spread of one "
            f"instance ({low:.2f}× to {high:.2f}×)"
        )
    else:
        verdict = f"{best.config['replicas']} replicas beat one instance in every run pair "
        verdict += f"({low:.2f}× to {high:.2f}×)"
    size, prev = last.config["max batch size"], before.config["max batch size"]
    if growth > 1.1:
        shape = (
            f"One instance's throughput was still growing with the batch ({growth:.2f}× from "
            f"{prev} to {size}), so what replicas change here is not a plateau but how the "
            "cores are used: each replica's shards run on their own cores with their own "
            "threads, on smaller batches"
        )
    else:
        shape = (
            f"One instance's throughput had flattened ({growth:.2f}× from {prev} to {size}), "
            "the case where replicas can use what one instance leaves idle"
        )
    return (
        f"\nReading: {verdict}. {shape}. On a device a small model cannot fill (a large GPU, "
        "a many-core host) replicas also use the capacity a single instance's plateau "
        "leaves idle; on a machine one instance already fills they split it.\n"
    )
