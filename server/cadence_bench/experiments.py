"""`cadence bench experiment E1|E2|E3|E4|E6`: launch cadence in each configuration an
experiment needs (docs/experiments/README.md says what each measures), run its workload,
write `docs/experiments/<E>.md` (the command, the table, a summary computed from the
numbers) and PNG plots beside it.

`--scale small` divides the documents' lengths and counts so each experiment runs in
minutes on 2 CPU cores; `--scale full` uses them as published (for a GPU).
"""

from __future__ import annotations

import asyncio
import platform
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import httpx  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from cadence_bench.datasets import (  # noqa: E402
    BenchRequest,
    PromptMaker,
    capped_exponential,
    load_tokenizer,
)
from cadence_bench.kv import (  # noqa: E402
    MetricsSampler,
    contiguous_slots,
    contiguous_utilization,
    largest_fitting_batch,
    running_at,
    shared_sampling_blocks,
)
from cadence_bench.metrics import summarize  # noqa: E402
from cadence_bench.runner import RunConfig, run_benchmark, warm_up  # noqa: E402
from cadence_bench.server_process import LaunchedServer  # noqa: E402

MODES = ("continuous", "dynamic", "static", "none")


@dataclass(slots=True)
class Scale:
    """Lengths divided by `div`, request counts set per scale."""

    div: int
    num_prompts: int
    rates: tuple[float, ...]

    def tokens(self, n: int) -> int:
        return max(1, n // self.div)


SCALES = {
    "small": Scale(div=4, num_prompts=24, rates=(1.0, 4.0)),
    "full": Scale(div=1, num_prompts=200, rates=(1.0, 4.0)),
}


@dataclass(slots=True)
class Row:
    config: dict[str, Any]
    result: dict[str, Any]
    latencies: list[float] = field(default_factory=list)


def _measure(url: str, requests: list[BenchRequest], rate: float, seed: int = 0) -> Row:
    cfg = RunConfig(url, request_rate=rate, ignore_eos=True, seed=seed, progress=True)
    outputs, duration = asyncio.run(run_benchmark(cfg, requests))
    return Row({}, summarize(outputs, duration), [o.latency for o in outputs if o.success])


def _serve(flags: list[str], name: str, work: Callable[[str], None]) -> None:
    with LaunchedServer(flags, name=name) as url:
        warm_up(RunConfig(url), BenchRequest("Warm up.", 3, 2))
        work(url)


def _requests(maker: PromptMaker, input_len: int, outputs: list[int]) -> list[BenchRequest]:
    return [BenchRequest(maker.make(input_len), input_len, o) for o in outputs]


def _rate_label(rate: float) -> str:
    return "all at once" if np.isinf(rate) else f"Poisson {rate:g}/s"


def _table(rows: list[Row], keys: list[str], metrics: list[tuple[str, str]]) -> str:
    head = "| " + " | ".join(keys + [label for label, _ in metrics]) + " |"
    lines = [head, "|" + "---|" * (len(keys) + len(metrics))]
    for r in rows:
        cells = [str(r.config[k]) for k in keys]
        cells += [f"{r.result[m]:.1f}" for _, m in metrics]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _header(name: str, title: str, scale: str, server_args: list[str]) -> str:
    cmd = f"cadence bench experiment {name} --scale {scale}"
    if server_args:
        cmd += f" --server-args {shlex.quote(' '.join(server_args))}"
    return (
        f"# {name}: {title}\n\n"
        f"Made by `{cmd}` on {time.strftime('%Y-%m-%d')}, {platform.machine()}, "
        f"{_cpus()} CPUs ({_cpu_class()}), Python {sys.version.split()[0]}; "
        "SmolLM2-135M-Instruct unless "
        "the server arguments say otherwise. Greedy decoding with EOS ignored, so every "
        "configuration generates exactly the same number of tokens.\n\n"
    )


def _cpu_class() -> str:
    """The CPU's model name and the instruction sets cadence's kernels can use on it."""
    from cadence import cpu_isa as isa

    return f"{isa.cpu_model()}: {', '.join(isa.supported())}"


def _cpus() -> int:
    import os

    return os.cpu_count() or 0


LATENCY_COLUMNS = [
    ("output tok/s", "output_throughput"),
    ("req/s", "request_throughput"),
    ("mean TTFT ms", "mean_ttft_ms"),
    ("mean TPOT ms", "mean_tpot_ms"),
    ("median E2E ms", "median_e2el_ms"),
    ("p99 E2E ms", "p99_e2el_ms"),
]


def e1(scale: Scale, out: Path, server_args: list[str], scale_name: str) -> None:
    """Batching modes side by side: prompts of 512 tokens, outputs 32/64/128/256 in turn,
    all at once and Poisson at the scale's rates."""
    maker = PromptMaker(load_tokenizer(None), np.random.default_rng(0))
    outputs = [scale.tokens(o) for o in (32, 64, 128, 256)]
    lengths = [outputs[i % 4] for i in range(scale.num_prompts)]
    requests = _requests(maker, scale.tokens(512), lengths)
    rates = (float("inf"), scale.rates[-1])  # the busier rate: batching matters there
    rows: list[Row] = []
    for mode in MODES:

        def work(url: str, mode: str = mode) -> None:
            for rate in rates:
                row = _measure(url, requests, rate)
                row.config = {"batching": mode, "arrivals": _rate_label(rate)}
                rows.append(row)

        _serve(["--batching", mode, *server_args], f"E1-{mode}", work)
    # Plot: output throughput per mode, one bar per arrival pattern.
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / len(rates)
    for j, rate in enumerate(rates):
        sel = [r for r in rows if r.config["arrivals"] == _rate_label(rate)]
        x = np.arange(len(sel)) + j * width
        axes[0].bar(x, [r.result["output_throughput"] for r in sel], width, label=_rate_label(rate))
        axes[1].bar(x, [r.result["mean_tpot_ms"] for r in sel], width, label=_rate_label(rate))
    for ax, title in zip(axes, ("output tokens/s", "mean time per output token (ms)"), strict=True):
        ax.set_xticks(np.arange(len(MODES)) + width * (len(rates) - 1) / 2, MODES)
        ax.set_title(title)
        ax.legend()
    fig.suptitle("E1: batching strategies")
    fig.tight_layout()
    fig.savefig(out / "E1-throughput.png", dpi=100)
    plt.close(fig)
    by = {(r.config["batching"], r.config["arrivals"]): r.result for r in rows}
    burst = _rate_label(float("inf"))
    cont = by[("continuous", burst)]["output_throughput"]
    summary = ", ".join(f"{cont / by[(m, burst)]['output_throughput']:.2f}× {m}" for m in MODES[1:])
    text = _header("E1", "batching strategies", scale_name, server_args)
    text += (
        f"{scale.num_prompts} requests, prompts of {scale.tokens(512)} tokens of English text, "
        f"outputs of {'/'.join(map(str, outputs))} tokens in turn (the documents' 512 and "
        f"32/64/128/256 divided by {scale.div}); sent all at once, then as a Poisson process "
        f"at {scale.rates[-1]:g} requests/s.\n\n"
        + _table(rows, ["batching", "arrivals"], LATENCY_COLUMNS)
        + f"\n\n![throughput and TPOT per batching mode](E1-throughput.png)\n\n"
        f"Computed from the table (all at once): continuous batching's output throughput is "
        f"{summary}.\n"
    )
    (out / "E1.md").write_text(text)


def e2(scale: Scale, out: Path, server_args: list[str], scale_name: str) -> None:
    """Static vs continuous as output-length variance grows: outputs ~ Exponential(mean
    128) capped at 32/128/512/1536; then latency CDFs at 1 and 4 requests/s."""
    rng = np.random.default_rng(0)
    maker = PromptMaker(load_tokenizer(None), rng)
    mean = 128.0 / scale.div
    caps = [scale.tokens(c) for c in (32, 128, 512, 1536)]
    input_len = scale.tokens(512)
    by_cap = {
        c: _requests(maker, input_len, capped_exponential(scale.num_prompts, c, rng, mean))
        for c in caps
    }
    cdf_cap = caps[1]
    rows: list[Row] = []
    cdf_rows: list[Row] = []
    modes = ("continuous", "static")
    for mode in modes:

        def work(url: str, mode: str = mode) -> None:
            for cap in caps:
                row = _measure(url, by_cap[cap], float("inf"))
                row.config = {"batching": mode, "cap": cap}
                rows.append(row)
            for rate in scale.rates:
                row = _measure(url, by_cap[cdf_cap], rate, seed=1)
                row.config = {"batching": mode, "rate": rate}
                cdf_rows.append(row)

        _serve(["--batching", mode, *server_args], f"E2-{mode}", work)
    fig, axes = plt.subplots(1, 1 + len(scale.rates), figsize=(5 * (1 + len(scale.rates)), 4))
    for mode in modes:
        sel = [r for r in rows if r.config["batching"] == mode]
        axes[0].plot(caps, [r.result["output_throughput"] for r in sel], "o-", label=mode)
        for ax, rate in zip(axes[1:], scale.rates, strict=True):
            (r,) = [r for r in cdf_rows if r.config == {"batching": mode, "rate": rate}]
            lat = np.sort(r.latencies)
            ax.step(lat, np.arange(1, len(lat) + 1) / len(lat), where="post", label=mode)
            ax.set_title(f"E2E latency CDF, {rate:g} req/s, cap {cdf_cap}")
            ax.set_xlabel("seconds")
            ax.legend()
    axes[0].set_xscale("log", base=2)
    axes[0].set_xlabel("output-length cap (tokens)")
    axes[0].set_title("output tokens/s, all at once")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out / "E2-variance.png", dpi=100)
    plt.close(fig)
    ratio = {
        c: next(r for r in rows if r.config == {"batching": "continuous", "cap": c}).result[
            "output_throughput"
        ]
        / next(r for r in rows if r.config == {"batching": "static", "cap": c}).result[
            "output_throughput"
        ]
        for c in caps
    }
    text = _header("E2", "throughput against output-length variance", scale_name, server_args)
    text += (
        f"{scale.num_prompts} requests per cap, prompts of {input_len} tokens, outputs drawn "
        f"from an exponential distribution of mean {mean:g} tokens, redrawn above the cap "
        f"(the documents' mean 128 and caps 32/128/512/1536 divided by {scale.div}); all "
        f"sent at once.\n\n"
        + _table(rows, ["batching", "cap"], LATENCY_COLUMNS)
        + f"\n\nLatency at fixed request rates (Poisson, cap {cdf_cap}):\n\n"
        + _table(cdf_rows, ["batching", "rate"], LATENCY_COLUMNS)
        + "\n\n![throughput against cap, latency CDFs](E2-variance.png)\n\n"
        "Computed from the table: continuous over static output throughput by cap: "
        + ", ".join(f"{c}: {v:.2f}×" for c, v in ratio.items())
        + ".\n"
    )
    (out / "E2.md").write_text(text)


E3_BATCH_SIZES = (1, 2, 4, 8, 16, 32)
E3_KV_BUDGET = "8MiB"  # a KV cache too small for 32 requests at full length
E3_REPLICAS = (1, 2, 4)
E3_REPLICA_REQUESTS = 64
E3_REPLICA_RUNS = 3  # per replica count, each with fresh prompts (no prefix-cache carry-over)


def _measure_sampled(url: str, requests: list[BenchRequest]) -> tuple[Row, MetricsSampler]:
    with MetricsSampler(url) as sampler:
        row = _measure(url, requests, float("inf"))
    return row, sampler


def e3(scale: Scale, out: Path, server_args: list[str], scale_name: str) -> None:
    """Throughput as --max-batch-size grows (the plateau), the largest batch a small KV
    budget holds, and one instance against several replicas of the model."""
    maker = PromptMaker(load_tokenizer(None), np.random.default_rng(1))
    input_len, output_len = scale.tokens(256), scale.tokens(128)
    num = max(E3_BATCH_SIZES)
    requests = _requests(maker, input_len, [output_len] * num)
    rows: list[Row] = []
    configs = [(b, None) for b in E3_BATCH_SIZES] + [(max(E3_BATCH_SIZES), E3_KV_BUDGET)]
    for size, budget in configs:
        flags = ["--max-batch-size", str(size), *server_args]
        if budget:
            flags += ["--kv-cache-memory", budget]

        def work(url: str, size: int = size, budget: str | None = budget) -> None:
            row, s = _measure_sampled(url, requests)
            total = int(s.peak("cadence_kv_blocks_total"))
            block_size = 16
            for arg, val in zip(server_args, server_args[1:], strict=False):
                if arg == "--block-size":
                    block_size = int(val)
            row.config = {
                "max batch size": size,
                "KV cache": budget or "default",
                "KV blocks": total,
                "fit at full length": largest_fitting_batch(
                    total, input_len, output_len, block_size
                ),
                "peak running": int(s.peak("cadence_running_requests")),
                "preemptions": int(s.peak("cadence_preemptions_total")),
            }
            rows.append(row)

        _serve(flags, f"E3-{size}-{budget or 'default'}", work)
    sweep = [r for r in rows if r.config["KV cache"] == "default"]
    tight = [r for r in rows if r.config["KV cache"] != "default"]
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
    fig.savefig(out / "E3-batch-size.png", dpi=100)
    plt.close(fig)
    best = max(sweep, key=lambda r: r.result["output_throughput"])
    base = sweep[0].result["output_throughput"]
    gains = ", ".join(
        f"{r.config['max batch size']}: {r.result['output_throughput'] / base:.2f}×" for r in sweep
    )
    keys = ["max batch size", "KV cache", "KV blocks", "fit at full length", "peak running"]
    keys.append("preemptions")
    text = _header("E3", "throughput against batch size", scale_name, server_args)
    text += (
        f"{num} requests sent at once, prompts of {input_len} tokens, outputs of {output_len} "
        f"(the documents' 256 and 128 divided by {scale.div}); cadence launched once per "
        f"`--max-batch-size` in {', '.join(map(str, E3_BATCH_SIZES))}, then once more at "
        f"{max(E3_BATCH_SIZES)} with `--kv-cache-memory {E3_KV_BUDGET}`. `KV blocks` is "
        "`cadence_kv_blocks_total` from the router's /metrics; `fit at full length` is "
        "blocks ÷ ceil((prompt + output) / block size), the largest batch that can run to "
        "the end without preemption; `peak running` and `preemptions` are the highest "
        "`cadence_running_requests` and `cadence_preemptions_total` seen polling /metrics "
        "every 50 ms. Each row is a single run: differences of a few percent are noise."
        "\n\n"
        + _table(rows, keys, LATENCY_COLUMNS)
        + "\n\n![throughput and TPOT against max batch size](E3-batch-size.png)\n\n"
        f"Computed from the table: output throughput relative to batch size 1: {gains}; the "
        f"highest is at {best.config['max batch size']}.\n"
    )
    for r in tight:
        text += (
            f"\nWith `--kv-cache-memory {r.config['KV cache']}` the cache has "
            f"{r.config['KV blocks']} blocks, enough for {r.config['fit at full length']} "
            f"requests at full length; the scheduler admitted up to {r.config['peak running']} "
            f"at once (a paged cache admits on the prompt's blocks and grows) and preempted "
            f"{r.config['preemptions']} times.\n"
        )
    text += _e3_replicas(maker, input_len, output_len, out, server_args, sweep)
    (out / "E3.md").write_text(text)


def _e3_replicas(
    maker: PromptMaker,
    input_len: int,
    output_len: int,
    out: Path,
    server_args: list[str],
    sweep: list[Row],
) -> str:
    """E3's second half: the same machine serving one instance, then 2 and 4 replicas
    (`--replicas`) behind one router; returns its section of E3.md."""
    import os

    runs = [
        _requests(maker, input_len, [output_len] * E3_REPLICA_REQUESTS)
        for _ in range(E3_REPLICA_RUNS)
    ]
    rows: list[Row] = []
    for n in E3_REPLICAS:

        def work(url: str, n: int = n) -> None:
            measured = [_measure(url, requests, float("inf")) for requests in runs]
            measured.sort(key=lambda r: r.result["output_throughput"])
            row = measured[len(measured) // 2]  # the median run
            routed = httpx.get(f"{url}/metrics", timeout=30).text
            low, high = (m.result["output_throughput"] for m in (measured[0], measured[-1]))
            row.config = {
                "replicas": n,
                "requests per replica": _routed(routed),
                "output tok/s, lowest–highest run": f"{low:.1f}–{high:.1f}",
                "low": low,
                "high": high,
            }
            rows.append(row)

        _serve(["--replicas", str(n), *server_args], f"E3-replicas-{n}", work)
    base = rows[0].result["output_throughput"]
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
    fig.savefig(out / "E3-replicas.png", dpi=100)
    plt.close(fig)
    cores = len(os.sched_getaffinity(0))
    ratios = ", ".join(
        f"{r.config['replicas']}: {r.result['output_throughput'] / base:.2f}×" for r in rows
    )
    return (
        "\n## One instance against replicas\n\n"
        f"{E3_REPLICA_REQUESTS} requests sent at once (prompts of {input_len} tokens, outputs "
        f"of {output_len}) to `cadence launch --replicas N` for N in "
        f"{', '.join(map(str, E3_REPLICAS))}, {E3_REPLICA_RUNS} runs each with fresh "
        "prompts "
        "(the table shows the median run and the range): N shard groups behind one "
        "router, which sends each request to the replica holding the fewest requests "
        "(then the least KV in use) "
        f"unless another caches its prompt prefix. On this machine's {cores} cores the "
        "launcher gives each shard its own cores and as many threads when there are enough "
        "cores, and one thread each, time-sharing all the cores, when there are more shards "
        "than cores; the KV memory is split evenly. `requests per replica` is "
        "`cadence_replica_requests_total` after the run (the warm-up request included).\n\n"
        + _table(
            rows,
            ["replicas", "requests per replica", "output tok/s, lowest–highest run"],
            LATENCY_COLUMNS,
        )
        + "\n\n![throughput and TPOT against replicas](E3-replicas.png)\n\n"
        f"Computed from the table: output throughput relative to one instance: {ratios}.\n"
        + _plateau_reading(sweep, rows)
    )


def _plateau_reading(sweep: list[Row], replica_rows: list[Row]) -> str:
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


def _routed(metrics_text: str) -> str:
    """`cadence_replica_requests_total` per replica, as `a / b / ...` (all of them with
    one replica, which exports no per-replica series)."""
    import re

    found = re.findall(
        r'^cadence_replica_requests_total\{[^}]*replica="(\d+)"\} (\S+)$', metrics_text, re.M
    )
    if not found:
        total = re.search(r"^cadence_requests_succeeded_total\{[^}]*\} (\S+)$", metrics_text, re.M)
        return total.group(1) if total else "?"
    return " / ".join(str(int(float(v))) for _, v in sorted(found, key=lambda f: int(f[0])))


def _sample_in_parallel(url: str, prompts: list[str], n: int, max_tokens: int) -> float:
    """Sends every prompt at once to /v1/completions with n samples; returns the wall time."""

    async def go() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=3600) as client:
            model = str((await client.get("/v1/models")).json()["data"][0]["id"])

            async def one(prompt: str) -> None:
                body = {
                    "model": model,
                    "prompt": prompt,
                    "max_tokens": max_tokens,
                    "n": n,
                    "temperature": 1.0,
                    "seed": 4,
                    "ignore_eos": True,
                }
                r = await client.post("/v1/completions", json=body)
                r.raise_for_status()

            await asyncio.gather(*(one(p) for p in prompts))

    start = time.perf_counter()
    asyncio.run(go())
    return time.perf_counter() - start


def e4(scale: Scale, out: Path, server_args: list[str], scale_name: str) -> None:
    """KV utilization, paged (measured) against reserving each request's maximum length
    contiguously (computed from the same requests); blocks saved by sharing a prompt
    across n parallel samples."""
    rng = np.random.default_rng(4)
    maker = PromptMaker(load_tokenizer(None), rng)
    input_lens = [scale.tokens(int(x)) for x in rng.integers(128, 512, scale.num_prompts)]
    max_new = capped_exponential(scale.num_prompts, scale.tokens(512), rng, 128.0 / scale.div)
    requests = [BenchRequest(maker.make(i), i, o) for i, o in zip(input_lens, max_new, strict=True)]
    block_size = 16
    for arg, val in zip(server_args, server_args[1:], strict=False):
        if arg == "--block-size":
            block_size = int(val)
    n_samples, share_prompts = 4, 4
    share_prompt_len, share_gen = scale.tokens(512), scale.tokens(128)
    share = [maker.make(share_prompt_len) for _ in range(share_prompts)]
    series: list[tuple[float, float, float, float, float]] = []  # t, paged/contig util, slots
    sharing: dict[int, tuple[int, float]] = {}
    row_holder: list[Row] = []

    def work(url: str) -> None:
        cfg = RunConfig(url, ignore_eos=True, progress=True)
        with MetricsSampler(url) as s:
            t0 = time.perf_counter()
            outputs, duration = asyncio.run(run_benchmark(cfg, requests))
        row_holder.append(Row({}, summarize(outputs, duration)))
        timings = [
            (q.prompt_len, q.output_len, o.ttft, o.itl, o.latency)
            for q, o in zip(requests, outputs, strict=True)
            if o.success
        ]
        for t, m in s.samples:
            running = running_at(t, t0, timings)
            if not running or m.get("cadence_running_requests", 0) == 0:
                continue
            series.append(
                (
                    t - t0,
                    m.get("cadence_kv_utilization", 0.0),
                    contiguous_utilization(running),
                    m.get("cadence_kv_blocks_used", 0.0) * block_size,
                    float(contiguous_slots(running)),
                )
            )
        for n in (1, n_samples):
            with MetricsSampler(url, every=0.02) as s:
                wall = _sample_in_parallel(url, share, n, share_gen)
            sharing[n] = (int(s.peak("cadence_kv_blocks_used")), wall)

    _serve(list(server_args), "E4", work)
    row = row_holder[0]
    arr = np.asarray(series) if series else np.zeros((1, 5))
    paged_util, contig_util = float(arr[:, 1].mean()), float(arr[:, 2].mean())
    paged_slots, contig_slots = float(arr[:, 3].mean()), float(arr[:, 4].mean())
    with_share, without_share = shared_sampling_blocks(
        share_prompt_len, share_gen, n_samples, block_size
    )
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
    fig.savefig(out / "E4-kv-utilization.png", dpi=100)
    plt.close(fig)
    b1, bn = sharing[1][0], sharing[n_samples][0]
    text = _header("E4", "KV memory utilization, paged against contiguous", scale_name, server_args)
    text += (
        f"{scale.num_prompts} requests sent at once, prompts of {min(input_lens)}-"
        f"{max(input_lens)} tokens (uniform 128-512 divided by {scale.div}), max_new_tokens "
        f"drawn from an exponential of mean {128 / scale.div:g} capped at "
        f"{scale.tokens(512)}, EOS ignored; block size {block_size}.\n\n"
        "Method. Paged numbers are measured: the router's /metrics polled every 50 ms "
        "during the run, `cadence_kv_utilization` (tokens stored ÷ slots of the blocks the "
        "running requests hold) and `cadence_kv_blocks_used` × block size. Contiguous "
        "numbers are computed, not measured (cadence has only the paged cache): at each "
        "sample, the requests running (from the client's timings: first token received, "
        "last not yet) would each reserve prompt + max_new_tokens slots; their stored "
        "tokens are prompt + tokens received so far; utilization is stored ÷ reserved. "
        "Both are averaged over the samples with requests running. The client-side view of "
        "'running' lags the server's by up to one step, so the two sets match to within "
        "a request or two at each instant.\n\n"
        + _table([row], [], LATENCY_COLUMNS)
        + "\n\n| cache | mean utilization | mean slots held |\n|---|---|---|\n"
        f"| paged (measured) | {paged_util:.3f} | {paged_slots:.0f} |\n"
        f"| contiguous at max length (computed) | {contig_util:.3f} | {contig_slots:.0f} |\n"
        + "\n![KV utilization and slots over the run](E4-kv-utilization.png)\n\n"
        f"Computed from the table: the contiguous reservation holds "
        f"{contig_slots / max(paged_slots, 1):.2f}× the slots the paged cache holds, at "
        f"{contig_util / max(paged_util, 1e-9):.2f}× its utilization.\n\n"
        f"## Parallel sampling\n\n{share_prompts} prompts of {share_prompt_len} tokens sent "
        f"at once to /v1/completions with {share_gen} tokens each, temperature 1, first "
        f"n=1 then n={n_samples}; peak `cadence_kv_blocks_used` polled every 20 ms:\n\n"
        "| n | peak blocks used | wall s |\n|---|---|---|\n"
        + "".join(f"| {n} | {b} | {w:.1f} |\n" for n, (b, w) in sharing.items())
        + f"\nWithout sharing, n={n_samples} would hold {n_samples}× the n=1 blocks: "
        f"{n_samples * b1}; measured {bn}, so sharing saved {n_samples * b1 - bn} blocks "
        f"({1 - bn / max(n_samples * b1, 1):.0%}). Analytically, one prompt's "
        f"{n_samples} samples hold {with_share} blocks shared against {without_share} "
        f"unshared at the end of generation ({share_prompts} prompts: "
        f"{share_prompts * with_share} against {share_prompts * without_share}).\n\n"
        "Not done: beam search is not implemented in cadence, so blocks saved under beam "
        "search have no numbers.\n"
    )
    (out / "E4.md").write_text(text)


def e6(scale: Scale, out: Path, server_args: list[str], scale_name: str) -> None:
    """Speculative decoding's speed-up against acceptance (its own module, which uses this
    one's helpers)."""
    from cadence_bench.speculative_experiment import e6 as run_e6

    run_e6(scale, out, server_args, scale_name)


EXPERIMENTS = {"E1": e1, "E2": e2, "E3": e3, "E4": e4, "E6": e6}


def run_experiment(
    name: str,
    scale: str,
    out_dir: str,
    server_args: list[str],
    divisor: int | None = None,
    num_prompts: int | None = None,
) -> None:
    if name not in EXPERIMENTS:
        raise SystemExit(f"{name} is not implemented; see docs/experiments")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = SCALES[scale]
    chosen = Scale(divisor or base.div, num_prompts or base.num_prompts, base.rates)
    label = scale
    if divisor:
        label += f" --length-divisor {divisor}"
    if num_prompts:
        label += f" --num-prompts {num_prompts}"
    EXPERIMENTS[name](chosen, out, server_args, label)
    print(f"wrote {out / (name + '.md')}")
