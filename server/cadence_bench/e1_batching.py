"""E1: the batching modes side by side on one workload. Prompts of 512 tokens, outputs of
32/64/128/256 in turn; sent all at once, then as Poisson processes at 0.5×, 0.9× and 1.5×
the saturation rate, which is the request throughput continuous batching reaches with
everything sent at once (measured first). The same requests and rates for every mode,
each arrival pattern with prompts of its own; `none` (one request at a time) gets the
first `none_prompts` of them."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from cadence_bench.datasets import BenchRequest, PromptMaker, load_tokenizer  # noqa: E402
from cadence_bench.exp_records import Record  # noqa: E402
from cadence_bench.exp_report import (  # noqa: E402
    LATENCY_COLUMNS,
    TRACE_NOTE,
    header,
    missing,
    rate_label,
    table,
    trace_table,
)
from cadence_bench.exp_runner import (  # noqa: E402
    Context,
    Measured,
    Planned,
    Progress,
    measure_requests,
    run_planned,
    workload_determinants,
)

MODES = ("continuous", "dynamic", "static", "none")
SATURATION_FACTORS = (0.5, 0.9, 1.5)  # below, near and above saturation
NONE_PROMPTS = 32  # requests for `none`: one at a time is slow
OUTPUTS = (32, 64, 128, 256)
PROMPT = 512
SATURATION_SLUG = "continuous-all-at-once"


def saturation_rates(
    saturation: float, factors: tuple[float, ...] = SATURATION_FACTORS
) -> list[float]:
    """The Poisson rates (requests/s) at these multiples of the saturation throughput."""
    if not saturation > 0:
        raise ValueError(f"saturation must be positive, got {saturation}")
    return [saturation * f for f in factors]


def arrival_slug(factor: float | None) -> str:
    return "all-at-once" if factor is None else f"poisson-{factor:g}x"


def _workload(ctx: Context, seed: int) -> list[BenchRequest]:
    maker = PromptMaker(load_tokenizer(None), np.random.default_rng(seed))
    outputs = [ctx.scale.tokens(o) for o in OUTPUTS]
    lengths = [outputs[i % len(outputs)] for i in range(ctx.scale.num_prompts)]
    prompt = ctx.scale.tokens(PROMPT)
    return [BenchRequest(maker.make(prompt), prompt, o) for o in lengths]


def pattern_seed(ctx: Context, factor: float | None) -> int:
    """The seed of an arrival pattern's prompts. The configurations of one mode share a
    launch, so each pattern draws its own prompts (the same for every mode): a pattern
    measured after another must not find that one's prompts in the prefix cache. All at
    once, measured first in each launch, keeps the experiment's seed."""
    return ctx.seed if factor is None else ctx.seed + 1 + SATURATION_FACTORS.index(factor)


def workloads(ctx: Context) -> dict[float | None, list[BenchRequest]]:
    """Each arrival pattern's requests (None: all at once)."""
    return {f: _workload(ctx, pattern_seed(ctx, f)) for f in (None, *SATURATION_FACTORS)}


def plan(
    ctx: Context,
    requests: dict[float | None, list[BenchRequest]],
    none_prompts: int,
    saturation: float | None,
) -> list[Planned]:
    """Every configuration in measuring order: continuous all at once first (its request
    throughput sets the rates), the Poisson ones only once `saturation` is known."""
    rates: list[tuple[float | None, float]] = [(None, math.inf)]
    if saturation is not None:
        rates += list(zip(SATURATION_FACTORS, saturation_rates(saturation), strict=True))
    items = []
    for mode in MODES:
        for factor, rate in rates:
            reqs = requests[factor][:none_prompts] if mode == "none" else requests[factor]
            arrivals = rate_label(rate)
            if factor is not None:
                arrivals += f" ({factor:g}× saturation)"
            # all at once keeps the determinants (and records) it had before patterns
            # drew their own prompts
            seeds = {} if factor is None else {"prompt_seed": pattern_seed(ctx, factor)}

            def measure(url: str, reqs: list[BenchRequest] = reqs, rate: float = rate) -> Measured:
                return measure_requests(url, reqs, rate, seed=ctx.seed)

            items.append(
                Planned(
                    slug=f"{mode}-{arrival_slug(factor)}",
                    label=f"{mode}, {arrivals}",
                    config={"batching": mode, "arrivals": arrivals, "requests": len(reqs)},
                    flags=["--batching", mode, *ctx.server_args],
                    requests=len(reqs),
                    measure=measure,
                    determinants=workload_determinants(reqs, rate, factor=factor, **seeds),
                )
            )
    return items


def run(ctx: Context, none_prompts: int = NONE_PROMPTS) -> None:
    requests = workloads(ctx)
    none_prompts = min(none_prompts, ctx.scale.num_prompts)
    ctx.progress = Progress(ctx.name, len(MODES) * (1 + len(SATURATION_FACTORS)))
    first = plan(ctx, requests, none_prompts, None)
    burst = [i for i in first if i.slug == SATURATION_SLUG]
    # the rest's fingerprints wait for the saturation rate: guess them unmeasured unless
    # a record of theirs exists (the remaining time is rough anyway)
    ctx.progress.later = sum(
        none_prompts if mode == "none" else ctx.scale.num_prompts
        for mode in MODES
        for factor in (None, *SATURATION_FACTORS)
        if (slug := f"{mode}-{arrival_slug(factor)}") != SATURATION_SLUG
        and ctx.store.selected(slug)
        and not ctx.store.path(slug).exists()
    )
    records = run_planned(ctx, burst)
    ctx.progress.later = 0
    saturation = _saturation(records)
    items = plan(ctx, requests, none_prompts, saturation)
    rest = [i for i in items if i.slug != SATURATION_SLUG]
    if saturation is None:
        rest = [i for i in rest if i.slug.endswith("all-at-once")]
        print(
            f"[{ctx.name}] the Poisson runs wait for {SATURATION_SLUG}: its request "
            "throughput sets their rates",
            file=sys.stderr,
        )
    records |= run_planned(ctx, rest)
    render(ctx, items, records, requests, none_prompts, saturation)


def _saturation(records: dict[str, Record]) -> float | None:
    record = records.get(SATURATION_SLUG)
    return float(record.result["request_throughput"]) if record else None


def _order(by_mode: dict[str, float]) -> str:
    ranked = sorted(by_mode, key=lambda m: by_mode[m], reverse=True)
    text = f"{ranked[0]} {by_mode[ranked[0]]:.1f}"
    for prev, mode in zip(ranked, ranked[1:], strict=False):
        text += f" {'=' if by_mode[prev] == by_mode[mode] else '>'} {mode} {by_mode[mode]:.1f}"
    return text


def summary(rows: list[Record]) -> str:
    """Per arrival pattern: the modes ordered by output throughput, and whether
    continuous ≥ dynamic ≥ static ≥ none holds (computed from the table)."""
    lines = []
    for arrivals in dict.fromkeys(r.config["arrivals"] for r in rows):
        by_mode = {
            r.config["batching"]: float(r.result["output_throughput"])
            for r in rows
            if r.config["arrivals"] == arrivals
        }
        present = [m for m in MODES if m in by_mode]
        holds = all(by_mode[a] >= by_mode[b] for a, b in zip(present, present[1:], strict=False))
        verdict = "holds" if holds else "does not hold"
        if len(present) < len(MODES):
            verdict += f" among the {len(present)} modes measured"
        lines.append(
            f"- {arrivals}: {_order(by_mode)} output tok/s; continuous ≥ dynamic ≥ static ≥ "
            f"none {verdict}."
        )
    return "\n".join(lines) + "\n"


def _plot(rows: list[Record], path: Path) -> None:
    patterns = list(dict.fromkeys(r.config["arrivals"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / max(len(patterns), 1)
    for j, arrivals in enumerate(patterns):
        by_mode = {r.config["batching"]: r.result for r in rows if r.config["arrivals"] == arrivals}
        x = np.arange(len(MODES)) + j * width
        tput = [by_mode[m]["output_throughput"] if m in by_mode else 0.0 for m in MODES]
        tpot = [by_mode[m]["mean_tpot_ms"] if m in by_mode else 0.0 for m in MODES]
        axes[0].bar(x, tput, width, label=arrivals)
        axes[1].bar(x, tpot, width, label=arrivals)
    titles = ("output tokens/s", "mean time per output token (ms)")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xticks(np.arange(len(MODES)) + width * (len(patterns) - 1) / 2, MODES)
        ax.set_title(title)
        ax.legend(fontsize="small")
    fig.suptitle("E1: batching strategies")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def render(
    ctx: Context,
    items: list[Planned],
    records: dict[str, Record],
    requests: dict[float | None, list[BenchRequest]],
    none_prompts: int,
    saturation: float | None,
) -> None:
    rows = [records[i.slug] for i in items if i.slug in records]
    absent = [i.label for i in items if i.slug not in records]
    if saturation is None:
        absent += [
            f"{m}, Poisson at {f:g}× saturation (rates follow the continuous all-at-once run)"
            for m in MODES
            for f in SATURATION_FACTORS
        ]
    outputs = "/".join(str(ctx.scale.tokens(o)) for o in OUTPUTS)
    extra = [] if none_prompts == NONE_PROMPTS else [f"--none-prompts {none_prompts}"]
    text = header(ctx.name, "batching strategies", ctx.scale_name, ctx.server_args, rows, extra)
    text += (
        f"{len(requests[None])} requests for continuous, dynamic and static batching, the "
        f"first {none_prompts} of them for `none` (one request at a time: fewer requests keep "
        f"its runs within hours at full scale); each arrival pattern draws its own prompts, "
        f"the same for every mode (a mode's patterns share one launch, and a pattern must not "
        f"find an earlier one's prompts in the prefix cache); prompts of "
        f"{ctx.scale.tokens(PROMPT)} tokens of "
        f"English text, outputs of {outputs} tokens in turn (the documents' 512 and "
        f"32/64/128/256"
        + (f" divided by {ctx.scale.div}" if ctx.scale.div > 1 else "")
        + "). Sent all at once, then as Poisson processes at "
    )
    if saturation is not None:
        rates = saturation_rates(saturation)
        text += (
            ", ".join(f"{r:.3g}/s ({f:g}×)" for r, f in zip(rates, SATURATION_FACTORS, strict=True))
            + f" of the saturation rate {saturation:.3g} requests/s, the request throughput "
            "continuous batching measured with all requests sent at once: below, near and "
            "above saturation, the same rates for every mode.\n\n"
        )
    else:
        text += (
            f"{', '.join(f'{f:g}×' for f in SATURATION_FACTORS)} the saturation rate, which "
            "the continuous all-at-once run sets (not measured yet).\n\n"
        )
    text += table(rows, ["batching", "arrivals", "requests"], LATENCY_COLUMNS)
    if rows:
        _plot(rows, ctx.out / "E1-throughput.png")
        text += "\n\n![throughput and TPOT per batching mode](E1-throughput.png)\n\n"
        text += "Computed from the table, per arrival pattern:\n\n" + summary(rows)
    text += "\n## Step trace per mode\n\n" + TRACE_NOTE
    for mode in MODES:
        mine = [r for r in rows if r.config["batching"] == mode]
        if mine:
            text += f"### {mode}\n\n" + trace_table(mine, ["arrivals"]) + "\n\n"
    text += missing(absent)
    (ctx.out / "E1.md").write_text(text)
