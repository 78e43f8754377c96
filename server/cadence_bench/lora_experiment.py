"""E5: throughput and latency as the number of distinct LoRA adapters in a workload grows,
against the base model alone and against one merged copy of the model per adapter.

Every launch serves the embedded model's float copy (the merged copies are float too,
so all three serve the same way): the base model on the workload without adapters; LoRA
(`--lora-dir`) on the same requests, each naming one of N adapters; a merged copy fed
shares of the workload, from which `e5_arithmetic` composes the merged deployment, which
also runs for real up to a small N (every copy merged, launched, fed its share, stopped).
"""

from __future__ import annotations

import asyncio
import os
import platform
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from cadence_bench import e5_progress
from cadence_bench.adapter_maker import make_adapters
from cadence_bench.adapter_merge import MERGED_WEIGHTS, merge_adapter
from cadence_bench.adapter_workload import (
    Distribution,
    adapter_counts,
    assign_adapters,
    list_adapters,
    with_lora_dir,
)
from cadence_bench.datasets import BenchRequest, PromptMaker, load_tokenizer
from cadence_bench.e5_arithmetic import ShareTime, share_sizes
from cadence_bench.e5_progress import E5Progress, MergedShares
from cadence_bench.e5_records import E5Records, RealMerged, ServedRun, save
from cadence_bench.e5_report import PLOT, plot, probes_text, shares_table, summary, table
from cadence_bench.experiments import _cpu_class, _cpus
from cadence_bench.metrics import summarize
from cadence_bench.runner import RunConfig, run_benchmark, warm_up
from cadence_bench.server_process import LaunchedServer
from cadence_bench.speculative_experiment import _float_copy, _served_folder

RANK = 8
TARGETS = ("q_proj", "v_proj")
DISTRIBUTION = Distribution("uniform")
# A prompt whose greedy continuation the first made adapter changes from the first token
# (checked with PEFT), so the probes tell an applied adapter from an ignored one.
PROBE_PROMPT = "Once upon a time"
PROBE_TOKENS = 16
# Each share size is served this many times on the merged copy, fresh prompts each time,
# and the fastest counts: a small share is over in a second or two, where a first-time
# cost (a new batch shape) or a burst of other work on the machine would dominate it.
SHARE_PASSES = 2


@dataclass(frozen=True, slots=True)
class E5Plan:
    adapter_counts: tuple[int, ...]
    num_prompts: int
    input_len: int
    output_len: int
    concurrency: int  # most requests in flight
    real_merged_max: int  # the merged deployment also runs for real up to this N


PLANS = {
    # the documents' scale: prompts of 512 tokens, outputs of 128, a few hundred requests
    "full": E5Plan((1, 8, 64, 512, 2000), 256, 512, 128, 32, 8),
    "quick": E5Plan((1, 8, 64), 128, 64, 32, 32, 8),
}


def default_adapters_dir(float_folder: str) -> Path:
    return Path.home() / ".cache" / "cadence" / "lora-e5" / f"{Path(float_folder).name}-r{RANK}"


def ensure_adapters(float_folder: str, folder: Path, count: int) -> list[str]:
    """`count` adapters in `folder`, made there (seed 0) when fewer are."""
    try:
        return list_adapters(folder, count)
    except (ValueError, FileNotFoundError):
        start = time.perf_counter()
        make_adapters(float_folder, count, folder, rank=RANK, targets=TARGETS, seed=0)
        print(f"made {count} adapters in {folder} in {time.perf_counter() - start:.1f} s")
        return list_adapters(folder, count)


def _without_model_id(server_args: list[str]) -> list[str]:
    out, skip = [], False
    for arg in server_args:
        if skip:
            skip = False
        elif arg == "--model-id":
            skip = True
        elif not arg.startswith("--model-id="):
            out.append(arg)
    return out


def _launch_failure(err: Exception) -> str:
    """The last line of a failed launch's log (`LaunchedServer` names it after "see ")."""
    log = Path(str(err).rpartition("see ")[2])
    lines = (
        [ln.strip() for ln in log.read_text().splitlines() if ln.strip()] if log.is_file() else []
    )
    return (lines[-1] if lines else str(err))[:200]


@contextmanager
def timed_launch(flags: list[str], name: str) -> Iterator[tuple[str, float]]:
    """A launched cadence and the seconds from starting it to its first generated token."""
    start = time.perf_counter()
    with LaunchedServer(flags, name=name) as url:
        warm_up(RunConfig(url), BenchRequest("Warm up.", 3, 2))
        yield url, time.perf_counter() - start


def serve(url: str, requests: list[BenchRequest], concurrency: int) -> dict[str, Any]:
    cfg = RunConfig(url, max_concurrency=concurrency, ignore_eos=True, progress=True)
    outputs, duration = asyncio.run(run_benchmark(cfg, requests))
    result: dict[str, Any] = summarize(outputs, duration)
    result["errors"] = sorted({o.error for o in outputs if not o.success})[:3]
    return result


def probe(url: str, adapter: str | None = None) -> str:
    """Greedy continuation of the probe prompt (through `adapter`, if one is named)."""
    parameters: dict[str, Any] = {"max_new_tokens": PROBE_TOKENS}
    if adapter is not None:
        parameters["adapter_id"] = adapter
    try:
        r = httpx.post(
            f"{url}/generate", json={"inputs": PROBE_PROMPT, "parameters": parameters}, timeout=300
        )
        r.raise_for_status()
        return str(r.json()["generated_text"])
    except (httpx.HTTPError, KeyError, ValueError) as err:
        return f"error: {err}"


class Driver:
    """Runs E5's launches; every measurement lands in `records`."""

    def __init__(self, plan: E5Plan, model: str, server_args: list[str], adapters_dir: Path):
        self.plan = plan
        self.model = model
        self.server_args = server_args
        self.adapters_dir = adapters_dir
        self.maker = PromptMaker(load_tokenizer(None), np.random.default_rng(5))
        self.work = self.fresh(plan.num_prompts)
        self.names = ensure_adapters(model, adapters_dir, max(plan.adapter_counts))
        self.merge_root = adapters_dir.parent / "merged"

    def fresh(self, count: int) -> list[BenchRequest]:
        """Requests of the plan's lengths with prompts no earlier request had (no prefix
        cache carries over between measurements on one server)."""
        p = self.plan
        return [
            BenchRequest(self.maker.make(p.input_len), p.input_len, p.output_len)
            for _ in range(count)
        ]

    def flags(self, model: str | None = None) -> list[str]:
        return ["--model-id", model or self.model, *self.server_args]

    def workload(self, num_adapters: int) -> list[BenchRequest]:
        return assign_adapters(self.work, self.names[:num_adapters], DISTRIBUTION, seed=0)

    def base(self, probes: dict[str, str]) -> ServedRun:
        with timed_launch(self.flags(), "E5-base") as (url, _):
            probes["base model"] = probe(url)
            return ServedRun(0, result=serve(url, self.work, self.plan.concurrency))

    def lora(self, num_adapters: int, probes: dict[str, str]) -> ServedRun:
        requests = self.workload(num_adapters)
        run = ServedRun(num_adapters, counts=adapter_counts(requests))
        flags = with_lora_dir(self.flags(), str(self.adapters_dir))
        try:
            with timed_launch(flags, f"E5-lora-{num_adapters}") as (url, _):
                if num_adapters == 1:
                    probes["LoRA server, no adapter"] = probe(url)
                    probes[f"LoRA server, {self.names[0]}"] = probe(url, self.names[0])
                run.result = serve(url, requests, self.plan.concurrency)
        except (RuntimeError, TimeoutError) as err:
            run.error = _launch_failure(err)
            return run
        if run.result["completed"] == 0:
            run.error = "; ".join(run.result["errors"]) or "no request completed"
            run.result = {}
        return run

    def merged_shares(self, sizes: list[int], probes: dict[str, str]) -> tuple[Any, ...]:
        """One merged copy (the first adapter's) serving fresh requests at each share
        size; its launch-to-first-token time and its weights' read time."""
        copy = merge_adapter(self.model, self.adapters_dir / self.names[0], self.merge_root)
        shares: dict[int, ShareTime] = {}
        try:
            with timed_launch(self.flags(str(copy)), "E5-merged") as (url, switch_s):
                probes[f"merged copy of {self.names[0]}"] = probe(url)
                for k in sizes:
                    shares[k] = min(
                        (self.share_time(url, k) for _ in range(SHARE_PASSES)),
                        key=lambda t: t.duration_s,
                    )
            read_s = _weights_read_s(copy / MERGED_WEIGHTS)
        finally:
            shutil.rmtree(copy, ignore_errors=True)
        return shares, switch_s, read_s

    def share_time(self, url: str, k: int) -> ShareTime:
        result = serve(url, self.fresh(k), self.plan.concurrency)
        return ShareTime(k, result["duration_s"], int(result["total_output_tokens"]))

    def merged_for_real(self, num_adapters: int) -> RealMerged:
        """Every used adapter's copy merged, then launched, fed its requests and stopped
        in turn; the merges (done once, offline, in a deployment) are not timed."""
        requests = self.workload(num_adapters)
        tokens, total, switches = 0, 0.0, []
        for name in adapter_counts(requests):
            copy = merge_adapter(self.model, self.adapters_dir / name, self.merge_root)
            try:
                start = time.perf_counter()
                with timed_launch(self.flags(str(copy)), f"E5-real-{name}") as (url, switch_s):
                    share = [r for r in requests if r.adapter == name]
                    base_share = [BenchRequest(r.prompt, r.prompt_len, r.output_len) for r in share]
                    tokens += int(
                        serve(url, base_share, self.plan.concurrency)["total_output_tokens"]
                    )
                total += time.perf_counter() - start
                switches.append(switch_s)
            finally:
                shutil.rmtree(copy, ignore_errors=True)
        return RealMerged(num_adapters, tokens, total, sum(switches) / len(switches))


def _weights_read_s(path: Path) -> float:
    """Reading a copy's weights into memory (from the page cache: the launch just read
    them): what a switch would cost if nothing but the weights changed."""
    from safetensors.torch import load_file

    start = time.perf_counter()
    load_file(str(path))
    return time.perf_counter() - start


def run_e5(
    out_dir: str,
    server_args: list[str],
    quick: bool = False,
    num_prompts: int | None = None,
    adapters_dir: str | None = None,
    only: tuple[str, ...] = (),
    fresh: bool = False,
) -> E5Records | None:
    """Measures what `out_dir`'s progress file lacks (of it, the configurations whose slug
    contains one of `only`), saving after each launch; writes the report once every
    configuration is measured (None until then)."""
    plan = PLANS["quick" if quick else "full"]
    if num_prompts:
        plan = E5Plan(**{**asdict(plan), "num_prompts": num_prompts})
    model = _float_copy(_served_folder(server_args))
    folder = Path(adapters_dir) if adapters_dir else default_adapters_dir(model)
    out = Path(out_dir)
    progress = e5_progress.load(out, {**asdict(plan), "model": model}, fresh)
    todo = [slug for slug in progress.missing() if not only or any(text in slug for text in only)]
    started = time.perf_counter()
    if todo:
        if not progress.load_start:
            progress.load_start = os.getloadavg()[0]
        driver = Driver(plan, model, _without_model_id(server_args), folder)
        for i, slug in enumerate(todo, 1):
            measure_one(driver, progress, slug)
            e5_progress.save(progress, out)
            elapsed = (time.perf_counter() - started) / 60
            print(f"[E5 {i}/{len(todo)}] {slug}: done; E5 elapsed {elapsed:.1f} min", flush=True)
    if progress.missing():
        print(f"E5: not yet measured: {', '.join(progress.missing())} (run again to go on)")
        return None
    records = records_from(progress, folder)
    save(records, out / "E5-records.json")
    plot(records, out / PLOT)
    command = "cadence bench experiment E5" + (" --quick" if quick else "")
    if num_prompts:
        command += f" --num-prompts {num_prompts}"
    if server_args:
        command += f" --server-args '{' '.join(server_args)}'"
    (out / "E5.md").write_text(document(records, command))
    print(f"wrote {out / 'E5.md'}")
    return records


def measure_one(driver: Driver, progress: E5Progress, slug: str) -> None:
    """One configuration's launch(es), into `progress`."""
    if slug == "base":
        progress.base = driver.base(progress.probes)
    elif slug == "merged":
        counts = (adapter_counts(driver.workload(n)).values() for n in driver.plan.adapter_counts)
        sizes = share_sizes(c for each in counts for c in each)
        progress.merged = MergedShares(*driver.merged_shares(sizes, progress.probes))
    else:
        kind, _, n = slug.partition("-")
        if kind == "lora":
            progress.lora[int(n)] = driver.lora(int(n), progress.probes)
        else:
            progress.real[int(n)] = driver.merged_for_real(int(n))


def records_from(progress: E5Progress, folder: Path) -> E5Records:
    plan = progress.plan
    assert progress.base is not None and progress.merged is not None
    return E5Records(
        plan={**plan, "adapters_dir": str(folder)},
        machine=f"{platform.machine()}, {_cpus()} CPUs ({_cpu_class()})",
        base=progress.base,
        lora=[progress.lora[n] for n in plan["adapter_counts"]],
        shares=progress.merged.shares,
        switch_s=progress.merged.switch_s,
        weights_read_s=progress.merged.weights_read_s,
        real=[progress.real[n] for n in sorted(progress.real)],
        probes=progress.probes,
        load_average=(progress.load_start, os.getloadavg()[0]),
    )


def document(records: E5Records, command: str) -> str:
    p = records.plan
    real_ns = ", ".join(str(r.num_adapters) for r in records.real) or "none"
    return (
        "# E5: LoRA serving as the number of adapters grows\n\n"
        f"Made by `{command}` on {time.strftime('%Y-%m-%d')}, {records.machine}, Python "
        f"{sys.version.split()[0]}. Every launch serves `{p['model']}` (SmolLM2-135M-Instruct's "
        "float copy; the merged copies are float too) in cadence's default dtype for this "
        "CPU. Greedy decoding with EOS ignored, so every configuration generates exactly the "
        "same number of tokens.\n\n"
        f"Workload: {p['num_prompts']} requests, prompts of {p['input_len']} tokens of English "
        f"text, {p['output_len']} output tokens each, sent at once with at most "
        f"{p['concurrency']} in flight. **LoRA**: cadence launched with `--lora-dir "
        f"{p['adapters_dir']}`; each request names one of the first N of its adapters "
        f"(TGI's `parameters.adapter_id`), drawn uniformly (seed 0), so `adapters used` of "
        f"them appear. The adapters are rank {RANK} on {'/'.join(TARGETS)}, alpha 16, made by "
        "`cadence bench make-adapters` (random, ‖scaling·B·A‖ ≈ 10% of ‖W‖ per layer), and "
        "loaded on first use, so loading them counts. **Base**: the same requests without "
        "an adapter, cadence launched without LoRA. TTFT and ITL are the LoRA run's.\n\n"
        "**Merged copies** (one fine-tune per deployment, one deployment at a time on this "
        "machine): adapter i's c_i requests are served by a copy of the model with the "
        "adapter merged in (`cadence bench merge-adapter`, W + scaling·B·A), all c_i at once "
        "(up to the cap); then the next copy. One merged copy was launched and fed fresh "
        "requests of the same lengths at every share size the workloads hold (the table "
        "below the plot); the deployment's throughput is Σ tokens ÷ (Σ T(c_i) + copies × "
        "switch), summed over the adapters with requests. `switch = launch`: starting "
        f"`cadence launch` on a copy to its first token, measured {records.switch_s:.1f} s; "
        "`switch = weights read`: only reading a copy's weights into memory (page cache "
        f"warm), {records.weights_read_s:.2f} s, a lower bound no real switch beats. "
        f"`run for real` (N = {real_ns}): every used adapter's copy merged (untimed), "
        "launched, fed its own requests and stopped in turn, all of it timed.\n\n"
        + table(records)
        + f"\n\n![output throughput and latency against N]({PLOT})\n\n"
        + summary(records)
        + "\nOne merged copy serving each share size:\n\n"
        + shares_table(records)
        + "\n"
        + probes_text(records)
        + f"\nThe machine's 1-minute load average was {records.load_average[0]:.2f} when the "
        f"experiment started and {records.load_average[1]:.2f} when it ended.\n"
    )
