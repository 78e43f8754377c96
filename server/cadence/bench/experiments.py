"""`cadence bench experiment E1|E2|E3|E4`: launch cadence in each configuration an
experiment of MISSION.md needs, run its workload, write `docs/experiments/<E>.md` (the
command, the table, a summary computed from the numbers) and PNG plots beside it.

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
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from cadence.bench.datasets import (  # noqa: E402
    BenchRequest,
    PromptMaker,
    capped_exponential,
    load_tokenizer,
)
from cadence.bench.metrics import summarize  # noqa: E402
from cadence.bench.runner import RunConfig, run_benchmark, warm_up  # noqa: E402
from cadence.bench.server_process import LaunchedServer  # noqa: E402

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
        f"{_cpus()} CPUs, Python {sys.version.split()[0]}; SmolLM2-135M-Instruct unless "
        "the server arguments say otherwise. Greedy decoding with EOS ignored, so every "
        "configuration generates exactly the same number of tokens.\n\n"
    )


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


EXPERIMENTS = {"E1": e1, "E2": e2}


def run_experiment(
    name: str,
    scale: str,
    out_dir: str,
    server_args: list[str],
    divisor: int | None = None,
    num_prompts: int | None = None,
) -> None:
    if name not in EXPERIMENTS:
        raise SystemExit(f"{name} is not implemented yet (E1 and E2 are); see docs/experiments")
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
