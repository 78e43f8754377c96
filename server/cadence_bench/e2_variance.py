"""E2: static against continuous batching as output-length variance grows. Outputs drawn
from an exponential of mean 128, redrawn above a cap of 32/128/512/1536; prompts of 512;
all sent at once. Then latency CDFs under Poisson arrivals at 1 and 4 requests/s."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from cadence_bench.datasets import BenchRequest, PromptMaker, capped_exponential, load_tokenizer  # noqa: E402
from cadence_bench.exp_records import Record  # noqa: E402
from cadence_bench.exp_report import (
    LATENCY_COLUMNS,
    TRACE_NOTE,
    header,
    missing,
    rate_label,
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
    workload_determinants,
)  # noqa: E402

MODES = ("continuous", "static")
CAPS = (32, 128, 512, 1536)
MEAN = 128.0
PROMPT = 512
CDF_CAP = 1  # index into the caps of the workload the latency CDFs use


def plan(
    ctx: Context,
    by_cap: dict[int, list[BenchRequest]],
    by_rate: dict[float, list[BenchRequest]],
    cdf_cap: int,
) -> list[Planned]:
    """Per mode: every cap all at once, then the CDF cap's lengths at each Poisson rate
    (one launch per mode: the configurations of a mode follow each other)."""
    items = []
    for mode in MODES:
        runs = [(f"{mode}-cap{cap}", cap, math.inf) for cap in by_cap]
        runs += [(f"{mode}-poisson-{rate:g}", cdf_cap, rate) for rate in ctx.scale.rates]
        for slug, cap, rate in runs:
            reqs = by_cap[cap] if math.isinf(rate) else by_rate[rate]
            seed = 0 if math.isinf(rate) else 1

            def measure(
                url: str, reqs: list[BenchRequest] = reqs, rate: float = rate, seed: int = seed
            ) -> Measured:
                return measure_requests(url, reqs, rate, seed=seed)

            config: dict[str, object] = {"batching": mode, "cap": cap}
            if not math.isinf(rate):
                config["rate"] = rate
            arrivals = rate_label(rate)
            items.append(
                Planned(
                    slug=slug,
                    label=f"{mode}, cap {cap}, {arrivals}",
                    config=config,
                    flags=["--batching", mode, *ctx.server_args],
                    requests=len(reqs),
                    measure=measure,
                    determinants=workload_determinants(reqs, rate, arrival_seed=seed),
                )
            )
    return items


def run(ctx: Context) -> None:
    rng = np.random.default_rng(ctx.seed)
    maker = PromptMaker(load_tokenizer(None), rng)
    mean = MEAN / ctx.scale.div
    caps = [ctx.scale.tokens(c) for c in CAPS]
    input_len = ctx.scale.tokens(PROMPT)
    n = ctx.scale.num_prompts
    by_cap = {
        c: [
            BenchRequest(maker.make(input_len), input_len, o)
            for o in capped_exponential(n, c, rng, mean)
        ]
        for c in caps
    }
    # Each rate's requests have the CDF cap's output lengths and prompts of their own: a
    # launch serves every configuration of its mode, and a rate measured after the caps
    # must not find their prompts in the prefix cache.
    by_rate = {
        rate: [BenchRequest(maker.make(input_len), input_len, r.output_len) for r in by_cap[cdf]]
        for cdf in [caps[CDF_CAP]]
        for rate in ctx.scale.rates
    }
    items = plan(ctx, by_cap, by_rate, caps[CDF_CAP])
    ctx.progress = Progress(ctx.name, len(items))
    records = run_planned(ctx, items)
    render(ctx, items, records, caps, mean, input_len)


def _plot(
    sweep: list[Record], at_rates: list[Record], rates: tuple[float, ...], path: Path
) -> None:
    fig, axes = plt.subplots(1, 1 + len(rates), figsize=(5 * (1 + len(rates)), 4))
    for mode in MODES:
        mine = [r for r in sweep if r.config["batching"] == mode]
        axes[0].plot(
            [r.config["cap"] for r in mine],
            [r.result["output_throughput"] for r in mine],
            "o-",
            label=mode,
        )
        for ax, rate in zip(axes[1:], rates, strict=True):
            found = [
                r for r in at_rates if r.config["batching"] == mode and r.config["rate"] == rate
            ]
            if not found:
                continue
            lat = np.sort(found[0].latencies)
            ax.step(lat, np.arange(1, len(lat) + 1) / max(len(lat), 1), where="post", label=mode)
            ax.set_title(f"E2E latency CDF, {rate:g} req/s, cap {found[0].config['cap']}")
            ax.set_xlabel("seconds")
            ax.legend()
    axes[0].set_xscale("log", base=2)
    axes[0].set_xlabel("output-length cap (tokens)")
    axes[0].set_title("output tokens/s, all at once")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _ratios(sweep: list[Record], caps: list[int]) -> str:
    by = {(r.config["batching"], r.config["cap"]): r.result["output_throughput"] for r in sweep}
    pairs = [
        f"{c}: {by[('continuous', c)] / by[('static', c)]:.2f}×"
        for c in caps
        if ("continuous", c) in by and ("static", c) in by and by[("static", c)] > 0
    ]
    return ", ".join(pairs) if pairs else "no cap measured in both modes yet"


def render(
    ctx: Context,
    items: list[Planned],
    records: dict[str, Record],
    caps: list[int],
    mean: float,
    input_len: int,
) -> None:
    rows = [records[i.slug] for i in items if i.slug in records]
    sweep = [r for r in rows if "rate" not in r.config]
    at_rates = [r for r in rows if "rate" in r.config]
    div = ctx.scale.div
    text = header(
        ctx.name, "throughput against output-length variance", ctx.scale_name, ctx.server_args, rows
    )
    text += (
        f"{ctx.scale.num_prompts} requests per cap, prompts of {input_len} tokens, outputs "
        f"drawn from an exponential distribution of mean {mean:g} tokens, redrawn above the "
        f"cap (the documents' mean 128 and caps 32/128/512/1536"
        + (f" divided by {div}" if div > 1 else "")
        + "); all sent at once.\n\n"
        + table(sweep, ["batching", "cap"], LATENCY_COLUMNS)
        + f"\n\nLatency at fixed request rates (Poisson, cap {caps[CDF_CAP]}):\n\n"
        + table(at_rates, ["batching", "rate"], LATENCY_COLUMNS)
    )
    if rows:
        _plot(sweep, at_rates, ctx.scale.rates, ctx.out / "E2-variance.png")
        text += "\n\n![throughput against cap, latency CDFs](E2-variance.png)\n"
    text += (
        "\nComputed from the table: continuous over static output throughput by cap: "
        + _ratios(sweep, caps)
        + ".\n\n## Step trace per mode\n\n"
        + TRACE_NOTE
    )
    for mode in MODES:
        mine = [r for r in rows if r.config["batching"] == mode]
        if mine:
            text += f"### {mode}\n\n" + trace_table(mine, ["cap", "rate"]) + "\n\n"
    text += missing([i.label for i in items if i.slug not in records])
    (ctx.out / "E2.md").write_text(text)
