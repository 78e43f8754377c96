"""E3: throughput as `--max-batch-size` grows (the plateau), the largest batch a small KV
budget holds, then one instance against replicas (`e3_replicas`)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from cadence_bench import e3_replicas  # noqa: E402
from cadence_bench.datasets import BenchRequest, PromptMaker, load_tokenizer  # noqa: E402
from cadence_bench.e4_kv import block_size_of  # noqa: E402
from cadence_bench.exp_records import Record  # noqa: E402
from cadence_bench.exp_report import (
    LATENCY_COLUMNS,
    TRACE_NOTE,
    header,
    missing,
    table,
    trace_table,
)  # noqa: E402
from cadence_bench.exp_runner import (
    Context,
    Measured,
    Planned,
    Progress,
    measure_requests,
    run_planned,
)  # noqa: E402
from cadence_bench.kv import MetricsSampler, largest_fitting_batch  # noqa: E402

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)  # past where a 2-core CPU's step saturates
KV_BUDGET_MIB = 64  # at full length: about 7 requests of SmolLM2's (a bfloat16 cache)


def kv_budget(div: int) -> str:
    """A KV cache that holds about 7 requests at full length, whatever the divisor (the
    blocks a request needs shrink with its length; 8 MiB at lengths / 8)."""
    return f"{max(1, KV_BUDGET_MIB // div)}MiB"


PROMPT, OUTPUT = 256, 128


def _measure(url: str, requests: list[BenchRequest], block_size: int) -> Measured:
    with MetricsSampler(url) as sampler:
        measured = measure_requests(url, requests, float("inf"))
    total = int(sampler.peak("cadence_kv_blocks_total"))
    first = requests[0]
    measured.columns = {
        "KV blocks": total,
        "fit at full length": largest_fitting_batch(
            total, first.prompt_len, first.output_len, block_size
        ),
        "peak running": int(sampler.peak("cadence_running_requests")),
        "preemptions": int(sampler.peak("cadence_preemptions_total")),
    }
    return measured


def plan(ctx: Context, requests: list[BenchRequest]) -> list[Planned]:
    block_size = block_size_of(ctx.server_args)
    configs = [(b, None) for b in BATCH_SIZES] + [(max(BATCH_SIZES), kv_budget(ctx.scale.div))]
    items = []
    for size, budget in configs:
        flags = ["--max-batch-size", str(size), *ctx.server_args]
        if budget:
            flags += ["--kv-cache-memory", budget]

        def measure(url: str) -> Measured:
            return _measure(url, requests, block_size)

        items.append(
            Planned(
                slug=f"batch-{size}" + (f"-kv-{budget}" if budget else ""),
                label=f"max batch size {size}" + (f", KV cache {budget}" if budget else ""),
                config={"max batch size": size, "KV cache": budget or "default"},
                flags=flags,
                requests=len(requests),
                measure=measure,
                determinants={
                    "prompt_len": requests[0].prompt_len,
                    "output_len": requests[0].output_len,
                },
            )
        )
    return items


def run(ctx: Context) -> None:
    maker = PromptMaker(load_tokenizer(None), np.random.default_rng(1 + ctx.seed))
    input_len, output_len = ctx.scale.tokens(PROMPT), ctx.scale.tokens(OUTPUT)
    # every size sees the same requests, at least enough to fill the largest batch
    count = max(ctx.scale.num_prompts, max(BATCH_SIZES))
    requests = [BenchRequest(maker.make(input_len), input_len, output_len) for _ in range(count)]
    runs = [
        [
            BenchRequest(maker.make(input_len), input_len, output_len)
            for _ in range(e3_replicas.REPLICA_REQUESTS)
        ]
        for _ in range(e3_replicas.REPLICA_RUNS)
    ]
    items = plan(ctx, requests) + e3_replicas.plan(ctx, runs)
    ctx.progress = Progress(ctx.name, len(items))
    records = run_planned(ctx, items)
    render(ctx, items, records, input_len, output_len)


def _plot(sweep: list[Record], tight: list[Record], path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    sizes = [r.config["max batch size"] for r in sweep]
    axes[0].plot(sizes, [r.result["output_throughput"] for r in sweep], "o-", label="default KV")
    for r in tight:
        axes[0].plot(
            [r.config["max batch size"]],
            [r.result["output_throughput"]],
            "s",
            label=f"KV {r.config['KV cache']} ({r.config['KV blocks']} blocks)",
        )
    axes[0].set_title("output tokens/s, all at once")
    axes[1].plot(sizes, [r.result["mean_tpot_ms"] for r in sweep], "o-")
    axes[1].set_title("mean time per output token (ms)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("--max-batch-size")
    axes[0].legend()
    fig.suptitle("E3: throughput against batch size")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _sweep_text(sweep: list[Record], tight: list[Record]) -> str:
    text = ""
    if sweep:
        best = max(sweep, key=lambda r: r.result["output_throughput"])
        base = sweep[0]
        first = base.result["output_throughput"]
        gains = ", ".join(
            f"{r.config['max batch size']}: {r.result['output_throughput'] / first:.2f}×"
            for r in sweep
        )
        text += (
            f"Computed from the table: output throughput relative to batch size "
            f"{base.config['max batch size']}: {gains}; the highest is at "
            f"{best.config['max batch size']}.\n"
        )
    for r in tight:
        text += (
            f"\nWith `--kv-cache-memory {r.config['KV cache']}` the cache has "
            f"{r.config['KV blocks']} blocks, enough for {r.config['fit at full length']} "
            f"requests at full length; the scheduler admitted up to {r.config['peak running']} "
            f"at once (a paged cache admits on the prompt's blocks and grows) and preempted "
            f"{r.config['preemptions']} times.\n"
        )
    return text


def render(
    ctx: Context, items: list[Planned], records: dict[str, Record], input_len: int, output_len: int
) -> None:
    rows = [records[i.slug] for i in items if i.slug in records]
    sweep = [r for r in rows if r.config.get("KV cache") == "default"]
    tight = [r for r in rows if r.config.get("KV cache") not in (None, "default")]
    replicas = [r for r in rows if "replicas" in r.config]
    keys = [
        "max batch size",
        "KV cache",
        "KV blocks",
        "fit at full length",
        "peak running",
        "preemptions",
    ]
    div = ctx.scale.div
    text = header(ctx.name, "throughput against batch size", ctx.scale_name, ctx.server_args, rows)
    text += (
        f"{items[0].requests} requests sent at once, prompts of {input_len} tokens, outputs of "
        f"{output_len} (the documents' 256 and 128"
        + (f" divided by {div}" if div > 1 else "")
        + "); "
        f"cadence launched once per `--max-batch-size` in {', '.join(map(str, BATCH_SIZES))}, "
        f"then once more at {max(BATCH_SIZES)} with `--kv-cache-memory {kv_budget(div)}` "
        "(about 7 requests at full length). `KV "
        "blocks` is `cadence_kv_blocks_total` from the router's /metrics; `fit at full "
        "length` is blocks ÷ ceil((prompt + output) / block size), the largest batch that can "
        "run to the end without preemption; `peak running` and `preemptions` are the "
        "highest `cadence_running_requests` and `cadence_preemptions_total` seen polling "
        "/metrics every 50 ms. Each row is a single run: differences of a few percent are "
        "noise.\n\n" + table(sweep + tight, keys, LATENCY_COLUMNS) + "\n\n"
    )
    if sweep or tight:
        _plot(sweep, tight, ctx.out / "E3-batch-size.png")
        text += "![throughput and TPOT against max batch size](E3-batch-size.png)\n\n"
    text += _sweep_text(sweep, tight)
    text += e3_replicas.section(ctx, replicas, sweep, input_len, output_len)
    text += "\n## Step trace\n\n" + TRACE_NOTE
    text += trace_table(sweep + tight, ["max batch size", "KV cache"]) + "\n\n"
    text += trace_table(replicas, ["replicas"]) + "\n"
    text += missing([i.label for i in items if i.slug not in records])
    (ctx.out / "E3.md").write_text(text)
