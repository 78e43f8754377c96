"""E4: KV memory utilization, the paged cache (measured from the router's /metrics)
against reserving each request's maximum length contiguously (computed from the same
requests' timings), then the blocks saved by sharing (`e4_sharing`)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from cadence_bench import e4_sharing  # noqa: E402
from cadence_bench.datasets import BenchRequest, PromptMaker, capped_exponential, load_tokenizer  # noqa: E402
from cadence_bench.exp_records import Record  # noqa: E402
from cadence_bench.exp_report import (
    LATENCY_COLUMNS,
    TRACE_NOTE,
    command,
    header,
    missing,
    table,
    trace_table,
)  # noqa: E402
from cadence_bench.exp_runner import (  # noqa: E402
    Context,
    Measured,
    Planned,
    Progress,
    every_one_served,
    run_planned,
)
from cadence_bench.kv import MetricsSampler, contiguous_slots, contiguous_utilization, running_at  # noqa: E402
from cadence_bench.metrics import summarize  # noqa: E402
from cadence_bench.runner import RunConfig, run_benchmark  # noqa: E402

PAGED_SLUG = "paged-vs-contiguous"


def block_size_of(server_args: list[str]) -> int:
    for arg, val in zip(server_args, server_args[1:], strict=False):
        if arg == "--block-size":
            return int(val)
    return 16


def _measure_paged(url: str, requests: list[BenchRequest], block_size: int) -> Measured:
    cfg = RunConfig(url, ignore_eos=True, progress=True)
    with MetricsSampler(url) as sampler:
        t0 = time.perf_counter()
        outputs, duration = asyncio.run(run_benchmark(cfg, requests))
    every_one_served(outputs)
    timings = [
        (q.prompt_len, q.output_len, o.ttft, o.itl, o.latency)
        for q, o in zip(requests, outputs, strict=True)
    ]
    series = []  # t, paged utilization, contiguous utilization, paged slots, contiguous slots
    for t, m in sampler.samples:
        running = running_at(t, t0, timings)
        if not running or m.get("cadence_running_requests", 0) == 0:
            continue
        series.append(
            [
                t - t0,
                m.get("cadence_kv_utilization", 0.0),
                contiguous_utilization(running),
                m.get("cadence_kv_blocks_used", 0.0) * block_size,
                float(contiguous_slots(running)),
            ]
        )
    result = summarize(outputs, duration)
    latencies = [o.latency for o in outputs]
    return Measured(result, latencies, {"series": series, "block_size": block_size})


def run(ctx: Context) -> None:
    rng = np.random.default_rng(4 + ctx.seed)
    maker = PromptMaker(load_tokenizer(None), rng)
    n, tok = ctx.scale.num_prompts, ctx.scale.tokens
    input_lens = [tok(int(x)) for x in rng.integers(128, 512, n)]
    max_new = capped_exponential(n, tok(512), rng, 128.0 / ctx.scale.div)
    requests = [BenchRequest(maker.make(i), i, o) for i, o in zip(input_lens, max_new, strict=True)]
    block_size = block_size_of(ctx.server_args)
    share_len, share_gen = tok(e4_sharing.SHARE_PROMPT_LEN), tok(e4_sharing.SHARE_GEN)
    share = [maker.make(share_len) for _ in range(e4_sharing.SHARE_PROMPTS)]

    def measure(url: str) -> Measured:
        return _measure_paged(url, requests, block_size)

    paged = Planned(
        slug=PAGED_SLUG,
        label="paged vs contiguous",
        config={"run": "paged vs contiguous"},
        flags=list(ctx.server_args),
        requests=len(requests),
        measure=measure,
        determinants={
            "input_lens": input_lens,
            "max_new": [int(x) for x in max_new],
            "block_size": block_size,
        },
    )
    items = [paged, *e4_sharing.plan(ctx, share, share_len, share_gen, block_size)]
    ctx.progress = Progress(ctx.name, len(items))
    records = run_planned(ctx, items)
    render(ctx, items, records, input_lens, block_size, share_len, share_gen)


def _plot(arr: np.ndarray, path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    axes[0].plot(arr[:, 0], arr[:, 1], label="paged (router /metrics)")
    axes[0].plot(arr[:, 0], arr[:, 2], label="contiguous, max length (computed)")
    axes[0].set_title("KV utilization: tokens stored ÷ slots held")
    axes[0].set_xlabel("seconds")
    axes[0].set_ylim(0, 1.05)
    axes[0].legend()
    axes[1].plot(arr[:, 0], arr[:, 3], label="paged: blocks used × block size")
    axes[1].plot(arr[:, 0], arr[:, 4], label="contiguous: Σ prompt + max_new")
    axes[1].set_title("KV slots held")
    axes[1].set_xlabel("seconds")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


METHOD = (
    "Method. Paged numbers are measured: the router's /metrics polled every 50 ms during "
    "the run, `cadence_kv_utilization` (tokens stored ÷ slots of the blocks the running "
    "requests hold) and `cadence_kv_blocks_used` × block size. Contiguous numbers are "
    "computed, not measured (cadence has only the paged cache): at each sample, the "
    "requests running (from the client's timings: first token received, last not yet) "
    "would each reserve prompt + max_new_tokens slots; their stored tokens are prompt + "
    "tokens received so far; utilization is stored ÷ reserved. Both are averaged over the "
    "samples with requests running. The client-side view of 'running' lags the server's "
    "by up to one step, so the two sets match to within a request or two at each instant."
    "\n\n"
)


def _paged_section(ctx: Context, record: Record) -> str:
    arr = np.asarray(record.extras["series"], dtype=np.float64)
    if arr.size == 0:
        arr = np.zeros((1, 5))
    _plot(arr, ctx.out / "E4-kv-utilization.png")
    paged_util, contig_util = float(arr[:, 1].mean()), float(arr[:, 2].mean())
    paged_slots, contig_slots = float(arr[:, 3].mean()), float(arr[:, 4].mean())
    return (
        table([record], [], LATENCY_COLUMNS)
        + "\n\n| cache | mean utilization | mean slots held |\n|---|---|---|\n"
        f"| paged (measured) | {paged_util:.3f} | {paged_slots:.0f} |\n"
        f"| contiguous at max length (computed) | {contig_util:.3f} | {contig_slots:.0f} |\n"
        "\n![KV utilization and slots over the run](E4-kv-utilization.png)\n\n"
        f"Computed from the table: the contiguous reservation holds "
        f"{contig_slots / max(paged_slots, 1):.2f}× the slots the paged cache holds, at "
        f"{contig_util / max(paged_util, 1e-9):.2f}× its utilization.\n\n"
    )


def render(
    ctx: Context,
    items: list[Planned],
    records: dict[str, Record],
    input_lens: list[int],
    block_size: int,
    share_len: int,
    share_gen: int,
) -> None:
    rows = [records[i.slug] for i in items if i.slug in records]
    div = ctx.scale.div
    title = "KV memory utilization, paged against contiguous, and blocks saved by sharing"
    text = header(ctx.name, title, ctx.scale_name, ctx.server_args, rows)
    text += (
        f"{len(input_lens)} requests sent at once, prompts of {min(input_lens)}-"
        f"{max(input_lens)} tokens (uniform 128-512"
        + (f" divided by {div}" if div > 1 else "")
        + f"), max_new_tokens drawn from an exponential of mean {128 / div:g} capped at "
        f"{ctx.scale.tokens(512)}, EOS ignored; block size {block_size}.\n\n" + METHOD
    )
    if PAGED_SLUG in records:
        text += _paged_section(ctx, records[PAGED_SLUG])
    cmd = command(ctx.name, ctx.scale_name, ctx.server_args)
    text += e4_sharing.sharing_section(ctx, records, share_len, share_gen, block_size, cmd)
    text += "\n## Step trace\n\n" + TRACE_NOTE
    text += trace_table(rows, ["run", "kind", "width"]) + "\n"
    text += missing([i.label for i in items if i.slug not in records])
    (ctx.out / "E4.md").write_text(text)
