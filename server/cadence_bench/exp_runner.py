"""Running an experiment's configurations one after the other: each is launched (cadence
started with its flags, a server kept up while the next configuration wants the same
flags), measured with the router's step trace around it, and recorded at once; a
configuration already recorded with the same fingerprint is skipped, so an interrupted
experiment resumes. One progress line per configuration goes to stderr."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cadence_bench.datasets import BenchRequest
from cadence_bench.exp_records import Record, RecordStore, fingerprint
from cadence_bench.metrics import RequestOutput, summarize
from cadence_bench.runner import RunConfig, run_benchmark, warm_up
from cadence_bench.server_process import LaunchedServer
from cadence_bench.step_trace import read_metrics, step_trace


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
    # the documents' lengths and a few hundred requests: hours on a 2-core CPU
    "full": Scale(div=1, num_prompts=200, rates=(1.0, 4.0)),
}


@dataclass(slots=True)
class Measured:
    """What one configuration's measurement returns (the step trace is added around it)."""

    result: dict[str, Any]
    latencies: list[float] = field(default_factory=list)
    extras: dict[str, Any] = field(default_factory=dict)
    columns: dict[str, Any] = field(default_factory=dict)  # table columns known only after


@dataclass(slots=True)
class Planned:
    """One configuration: `slug` names its record, `label` its progress line, `config`
    its table columns; `flags` are its `cadence launch` flags; `determinants` what else
    its measurement depends on (lengths, rate); `measure(url)` runs it."""

    slug: str
    label: str
    config: dict[str, Any]
    flags: list[str]
    requests: int
    measure: Callable[[str], Measured]
    determinants: dict[str, Any] = field(default_factory=dict)


class Progress:
    """`[E1 3/16] continuous, Poisson 1.4/s: launching` lines, with the elapsed time and
    a rough remaining time: the seconds per request of the configurations measured so
    far (launches included) times the requests still to measure."""

    def __init__(self, name: str, total: int) -> None:
        self.name = name
        self.total = total
        self.index = 0
        self.started = time.monotonic()
        self.seconds = 0.0  # measured so far, launches included
        self.requests = 0  # measured so far
        self.to_measure = 0  # requests still to measure
        self.later = 0  # requests of configurations the experiment plans after these

    def next(self) -> None:
        self.index += 1

    def say(self, label: str, what: str) -> None:
        print(
            f"[{self.name} {self.index}/{self.total}] {label}: {what}", file=sys.stderr, flush=True
        )

    def done(self, item: Planned, seconds: float, output_tps: float, wall: float) -> None:
        """`seconds`: the measurement; `wall`: with its launch, what the estimate uses."""
        label = item.label
        self.seconds += wall
        self.requests += item.requests
        self.to_measure = max(0, self.to_measure - item.requests)
        elapsed = time.monotonic() - self.started
        left = self.seconds / max(self.requests, 1) * (self.to_measure + self.later)
        self.say(
            label,
            f"done in {seconds:.0f} s (output {output_tps:.1f} tok/s); {self.name} elapsed "
            f"{_minutes(elapsed)}, about {_minutes(left)} left",
        )


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


class Servers:
    """At most one launched cadence, reused while consecutive configurations ask for the
    same flags; warmed up by one short request after each launch."""

    def __init__(self) -> None:
        self.flags: list[str] | None = None
        self.server: LaunchedServer | None = None
        self.url = ""

    def up(self, flags: list[str]) -> bool:
        return self.server is not None and self.flags == flags

    def get(self, flags: list[str], name: str) -> str:
        if self.up(flags):
            return self.url
        self.close()
        # an experiment sends up to hundreds of requests at once: none may be refused for
        # the default bounds on requests in flight and waiting (128 each)
        bounds: list[str] = []
        for flag in ("--max-concurrent-requests", "--max-waiting-requests"):
            bounds += [] if flag in flags else [flag, "100000"]
        server = LaunchedServer([*bounds, *flags], name=name)
        self.url = server.__enter__()
        self.server, self.flags = server, list(flags)
        warm_up(RunConfig(self.url), BenchRequest("Warm up.", 3, 2))
        return self.url

    def close(self) -> None:
        if self.server is not None:
            self.server.__exit__()
        self.server, self.flags, self.url = None, None, ""

    def __enter__(self) -> Servers:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


@dataclass(slots=True)
class Context:
    """One experiment's run: its scale, where it writes, the launch flags every
    configuration adds, its records, and whether to measure at all (`report_only`)."""

    name: str
    scale: Scale
    scale_name: str
    out: Path
    server_args: list[str]
    store: RecordStore
    report_only: bool = False
    seed: int = 0
    progress: Progress | None = None
    servers: Servers = field(default_factory=Servers)
    extra_flags: list[str] = field(default_factory=list)  # shown in the report's command

    def common(self) -> dict[str, Any]:
        """What every configuration's measurement depends on."""
        return {
            "experiment": self.name,
            "divisor": self.scale.div,
            "num_prompts": self.scale.num_prompts,
            "server_args": self.server_args,
            "seed": self.seed,
        }

    def fingerprint_of(self, item: Planned) -> str:
        return fingerprint(self.determinants(item))

    def determinants(self, item: Planned) -> dict[str, Any]:
        return self.common() | {"flags": item.flags, **item.determinants}


def workload_determinants(
    requests: list[BenchRequest], rate: float, **extra: Any
) -> dict[str, Any]:
    """What a run of `requests` at `rate` depends on besides the launch flags: the prompt
    length, every output length, the rate, and the experiment's `extra` settings."""
    outputs = [r.output_len for r in requests]
    return {"prompt_len": requests[0].prompt_len, "outputs": outputs, "rate": rate, **extra}


def measure_requests(
    url: str, requests: list[BenchRequest], rate: float, seed: int = 0
) -> Measured:
    """The requests sent at `rate` (inf: all at once), greedy with EOS ignored."""
    cfg = RunConfig(url, request_rate=rate, ignore_eos=True, seed=seed, progress=True)
    outputs, duration = asyncio.run(run_benchmark(cfg, requests))
    every_one_served(outputs)
    return Measured(summarize(outputs, duration), [o.latency for o in outputs])


def every_one_served(outputs: list[RequestOutput]) -> None:
    """Raises when a request failed: a run that lost requests measured another workload,
    so nothing of it may be recorded."""
    failed = [o.error for o in outputs if not o.success]
    if failed:
        raise RuntimeError(
            f"{len(failed)} of {len(outputs)} requests failed, e.g. {sorted(set(failed))[:3]}"
        )


def run_planned(ctx: Context, items: list[Planned]) -> dict[str, Record]:
    """Measures the configurations not yet recorded (those --only selects), in order;
    returns every matching record, old and new."""
    assert ctx.progress is not None
    progress = ctx.progress
    pending = [
        i
        for i in items
        if ctx.store.selected(i.slug) and ctx.store.reusable(i.slug, ctx.fingerprint_of(i)) is None
    ]
    progress.to_measure += 0 if ctx.report_only else sum(i.requests for i in pending)
    records: dict[str, Record] = {}
    for item in items:
        progress.next()
        print_ = ctx.fingerprint_of(item)
        old = ctx.store.reusable(item.slug, print_)
        if old is not None:
            progress.say(item.label, f"recorded in {ctx.store.path(item.slug)}, not measured again")
            records[item.slug] = old
            continue
        kept = ctx.store.stored(item.slug, print_)
        if not ctx.store.selected(item.slug) or ctx.report_only:
            why = "not measured (--report-only)" if ctx.report_only else "not selected (--only)"
            progress.say(item.label, why if kept is None else "recorded, kept")
            if kept is not None:
                records[item.slug] = kept
            continue
        if ctx.store.path(item.slug).exists() and not ctx.store.fresh:
            progress.say(item.label, "recorded with other settings: measuring again")
        began = time.monotonic()  # the launch counts in the remaining-time estimate
        if not ctx.servers.up(item.flags):
            progress.say(item.label, "launching")
        url = ctx.servers.get(item.flags, f"{ctx.name}-{item.slug}")
        progress.say(item.label, f"measuring {item.requests} requests")
        start = time.monotonic()
        before = read_metrics(url)
        measured = item.measure(url)
        after = read_metrics(url)
        took = time.monotonic() - start
        record = Record(
            experiment=ctx.name,
            slug=item.slug,
            config=item.config | measured.columns,
            result=measured.result,
            latencies=measured.latencies,
            trace=step_trace(before, after),
            extras=measured.extras,
            determinants=ctx.determinants(item),
            fingerprint=print_,
        )
        ctx.store.save(record)
        records[item.slug] = record
        output = float(measured.result.get("output_throughput", 0.0))
        progress.done(item, took, output, time.monotonic() - began)
    return records
