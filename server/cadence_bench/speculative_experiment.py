"""E6: speculative decoding's speed-up against its acceptance rate, at concurrency 1.

cadence is launched once without speculation, once per (k, A) with the synthetic proposer
(`--speculative synthetic --num-speculative-tokens k --speculative-acceptance A`: arbitrary
proposals the shard accepts at rate A, at the real cost of verifying them), and once per
real proposer: n-gram prompt lookup, the served model as its own draft, and that draft
quantized to int4. Every run sends the same grounded prompts (a passage the model is asked
to repeat or correct, so prompt lookup has spans to find) one at a time, greedy, EOS
ignored. The measured acceptance comes from the router's /metrics; the theory curves
(`cadence_bench.speculation`) are drawn over the points. Each launch's measurement is a
record (`exp_runner`): an interrupted run resumes, `--only` picks launches by slug.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import matplotlib.pyplot as plt
import numpy as np

from cadence_bench.datasets import (
    BenchRequest,
    GroundedPromptMaker,
    load_chat_renderer,
    load_tokenizer,
)
from cadence_bench.exp_records import Record
from cadence_bench.exp_report import header, missing
from cadence_bench.exp_runner import (
    Context,
    Measured,
    Planned,
    Progress,
    every_one_served,
    run_planned,
)
from cadence_bench.metrics import summarize
from cadence_bench.runner import RunConfig, run_benchmark
from cadence_bench.speculation import (
    SpecCounts,
    acceptance_of,
    expected_tokens,
    fit_proposal_cost,
    read_spec_counts,
    theory_speedup,
)

KS = (1, 2, 4, 8)
ACCEPTANCES = {"small": (0.0, 0.5, 0.9), "full": (0.0, 0.3, 0.5, 0.7, 0.9)}
REAL_K = 4  # the router's default --num-speculative-tokens, for the real proposers
# Large enough that the load switch never drops a proposal at concurrency 1 (k = 8: 9).
MAX_STEP_TOKENS = 64
PASSES = 2


@dataclass(slots=True)
class Run:
    label: str  # "off", "off float", "synthetic", "n-gram", "draft", "draft int4"
    flags: list[str]
    k: int = 0  # most proposals per step (0: off)
    set_acceptance: float | None = None  # synthetic's A
    result: dict[str, Any] = field(default_factory=dict)
    counts: SpecCounts = field(default_factory=SpecCounts)
    error: str = ""
    # the run without speculation it is compared to (the int4 twin's target is the float
    # model: the embedded one is int4 already)
    baseline: str = "off"

    @property
    def tok_s(self) -> float:
        return float(self.result.get("output_throughput", 0.0))

    @property
    def acceptance(self) -> float:
        return acceptance_of(self.counts)

    @property
    def slug(self) -> str:
        """Its record's name: "off", "synthetic-k4-a0.5", "draft-int4-k4"."""
        parts = [self.label.replace(" ", "-")]
        parts += [f"k{self.k}"] if self.k else []
        parts += [f"a{self.set_acceptance:g}"] if self.set_acceptance is not None else []
        return "-".join(parts)

    @property
    def required(self) -> bool:
        """The baselines and the synthetic proposer must run; a real proposer may fail to
        start on some machines (the report says why)."""
        return self.label in ("off", "off float", "synthetic")


def _spec_counts(url: str) -> SpecCounts:
    return read_spec_counts(httpx.get(f"{url}/metrics", timeout=30).text)


def _one_at_a_time(url: str, requests: list[BenchRequest]) -> Measured:
    """The requests in turn, PASSES times; the fastest pass counts (the machine is shared:
    a burst of other work slows one pass, not the configuration)."""
    cfg = RunConfig(url, max_concurrency=1, ignore_eos=True, progress=True)
    best: Measured | None = None
    for _ in range(PASSES):
        before = _spec_counts(url)
        outputs, duration = asyncio.run(run_benchmark(cfg, requests))
        every_one_served(outputs)
        counts = _spec_counts(url).since(before)
        result = summarize(outputs, duration)
        if best is None or result["output_throughput"] > best.result["output_throughput"]:
            latencies = [o.latency for o in outputs]
            best = Measured(result, latencies, extras={"counts": asdict(counts)})
    assert best is not None
    return best


def _served_folder(server_args: list[str]) -> str:
    """The model folder `cadence launch` serves under these flags (--model-id or the
    embedded model), for the draft model to be the served one."""
    from cadence.model_source import resolve_model

    model_id = None
    for flag, value in zip(server_args, server_args[1:], strict=False):
        if flag == "--model-id":
            model_id = value
    return resolve_model(model_id)


def _float_copy(folder: str) -> str:
    """The served model as float32 safetensors: itself, or for a GGUF folder its
    dequantized copy (made once, beside it, as `cadence convert` makes it)."""
    from cadence.convert import convert_gguf
    from cadence.quant.checkpoints import GGUF_WEIGHTS

    gguf = Path(folder) / GGUF_WEIGHTS
    if not gguf.exists():
        return folder
    return str(convert_gguf(gguf, Path(folder).with_name(f"{Path(folder).name}-float32")))


def _failure(message: str) -> str:
    """The last error line of the launch's log (`LaunchedServer` names it after "see ")."""
    log = Path(message.rpartition("see ")[2])
    lines = log.read_text().splitlines() if log.is_file() else []
    errors = [line.strip() for line in lines if "Error: " in line]
    return errors[-1].split("Error: ", 1)[1] if errors else message


def speedup(run: Run, runs: list[Run]) -> float:
    """`run`'s output tok/s over its baseline's (0 when that did not run)."""
    base = next((r.tok_s for r in runs if r.label == run.baseline), 0.0)
    return run.tok_s / base if base else 0.0


def plan_runs(acceptances: tuple[float, ...], folder: str, float_folder: str) -> list[Run]:
    """Every launch of E6, the baseline first. The int4 twin drafts for the model's float
    copy served in bfloat16 (`float_folder`), against that target without speculation."""
    spec = ["--speculative-max-step-tokens", str(MAX_STEP_TOKENS)]
    runs = [Run("off", [])]
    for k in KS:
        for a in acceptances:
            flags = ["--speculative", "synthetic", "--num-speculative-tokens", str(k)]
            flags += ["--speculative-acceptance", str(a), *spec]
            runs.append(Run("synthetic", flags, k, a))
    real = ["--num-speculative-tokens", str(REAL_K), *spec]
    draft = ["--speculative", "draft", "--draft-model-id", folder, *real]
    runs.append(Run("n-gram", ["--speculative", "ngram", *real], REAL_K))
    runs.append(Run("draft", draft, REAL_K))
    target = ["--model-id", float_folder, "--dtype", "bfloat16"]
    runs.append(Run("off float", target, baseline="off float"))
    twin = [*target, "--speculative", "draft", "--draft-model-id", float_folder, *real]
    twin += ["--draft-quantize", "int4"]
    runs.append(Run("draft int4", twin, REAL_K, baseline="off float"))
    return runs


def _planned(run: Run, requests: list[BenchRequest], seed: int, server_args: list[str]) -> Planned:
    return Planned(
        slug=run.slug,
        label=run.slug,
        config={"proposer": run.label, "k": run.k, "set_acceptance": run.set_acceptance},
        flags=[*run.flags, *server_args],
        requests=len(requests) * PASSES,
        measure=lambda url: _one_at_a_time(url, requests),
        determinants={
            "prompt_len": requests[0].prompt_len,
            "outputs": [r.output_len for r in requests],
            "passes": PASSES,
            "prompt_seed": seed,
        },
    )


def _take(run: Run, record: Record) -> None:
    run.result = record.result
    run.counts = SpecCounts(**record.extras["counts"])


def run(ctx: Context) -> None:
    full = ctx.scale_name.startswith("full")
    acceptances = ACCEPTANCES["full" if full else "small"]
    num = max(2, ctx.scale.num_prompts // 6)
    input_len, output_len = ctx.scale.tokens(512), ctx.scale.tokens(256)
    seed = 6
    tok = load_tokenizer(None)
    maker = GroundedPromptMaker(tok, load_chat_renderer(None), np.random.default_rng(seed))
    requests = [BenchRequest(maker.make(input_len)[0], input_len, output_len) for _ in range(num)]
    folder = _served_folder(ctx.server_args)
    float_folder = _float_copy(folder)
    runs = plan_runs(acceptances, folder, float_folder)
    ctx.progress = Progress(ctx.name, len(runs))
    load_before = os.getloadavg()[0]  # the machine may be shared: the doc says how busy
    records: list[Record] = []
    absent: list[str] = []
    items = [_planned(r, requests, seed, ctx.server_args) for r in runs]
    # each launch goes through run_planned alone: the estimate of the time left needs the
    # requests of the launches after it that are still to measure
    unmeasured = [
        0
        if ctx.report_only
        or not ctx.store.selected(i.slug)
        or ctx.store.reusable(i.slug, ctx.fingerprint_of(i))
        else i.requests
        for i in items
    ]
    for index, (r, item) in enumerate(zip(runs, items, strict=True)):
        ctx.progress.later = sum(unmeasured[index + 1 :])
        try:
            found = run_planned(ctx, [item])
        except (RuntimeError, TimeoutError) as err:
            ctx.servers.close()
            if r.required:
                raise
            r.error = _failure(str(err))  # a real proposer that cannot run here
            continue
        if item.slug in found:
            records.append(found[item.slug])
            _take(r, found[item.slug])
        else:
            absent.append(item.slug)
    text = header(ctx.name, "speculative decoding: speed-up against acceptance", ctx.scale_name,
                  ctx.server_args, records)  # fmt: skip
    text += _describe(num, input_len, output_len, acceptances, folder)
    measured = [r for r in runs if r.result or r.error]
    off = runs[0].tok_s
    if off and any(r.label == "synthetic" and r.counts.drafts for r in measured):
        synthetic = [r for r in measured if r.label == "synthetic"]
        cost = fit_proposal_cost(
            {r.k: r.tok_s / off for r in synthetic if r.set_acceptance == 0.0 and r.tok_s > 0}
        )
        _plot(measured, off, cost, ctx.out / "E6-speedup.png")
        text += _table(measured, off, cost)
        text += "\n\n![speed-up and tokens per verification against acceptance](E6-speedup.png)\n\n"
        text += _summary(measured, off, cost)
    text += (
        f"\nThe machine's 1-minute load average was {load_before:.2f} when the experiment "
        f"started and {os.getloadavg()[0]:.2f} when it ended.\n"
    )
    text += missing(absent)
    (ctx.out / "E6.md").write_text(text)


def _describe(
    num: int, input_len: int, output_len: int, acceptances: tuple[float, ...], folder: str
) -> str:
    return (
        f"{num} grounded requests (`--dataset-name grounded`: SmolLM2's chat template around "
        f"a passage of the corpus to repeat or to rewrite with its spelling fixed), prompts "
        f"of {input_len} tokens, {output_len} output tokens each, sent one at a time "
        f"(concurrency 1), {PASSES} passes per launch of which the faster counts. cadence "
        "is launched without speculation, then once per k in "
        f"{', '.join(map(str, KS))} and A in {', '.join(f'{a:g}' for a in acceptances)} with "
        "`--speculative synthetic --num-speculative-tokens k --speculative-acceptance A` "
        "(the shard accepts each arbitrary proposal with probability A while the ones "
        "before it were accepted: the real cost of verification at a set acceptance), then "
        f"with the real proposers at `--num-speculative-tokens {REAL_K}` (the router adapts "
        "each request's k to its acceptance): `--speculative ngram`, `--speculative draft "
        f"--draft-model-id {folder}` (the served model as its own draft), and its int4 twin: "
        "the served model's float copy in bfloat16 drafted for by the same weights "
        "quantized at load (`--draft-quantize int4`), against that float target without "
        "speculation (`off float`; the embedded model is int4 already). Every speculative "
        "launch has "
        f"`--speculative-max-step-tokens {MAX_STEP_TOKENS}`, so the load switch never drops "
        "a proposal at concurrency 1.\n\n"
        "Measured acceptance `a`: the per-proposal acceptance whose expected tokens per "
        "verification, E = (1 - a^(k+1)) / (1 - a) at the run's mean k, equals the measured "
        "1 + accepted / verifications (router /metrics, `vllm:spec_decode_num_drafts_total`, "
        "`..._num_draft_tokens_total`, `..._num_accepted_tokens_total`, counted over the run "
        "only). `accepted ÷ proposed` is vLLM's acceptance rate. Speed-up = output tok/s ÷ "
        "the run without speculation. Theory: E / (1 + c k), with c = 0 (a free proposer, "
        "a free verification) and with c fitted to the synthetic runs at A = 0, where "
        "nothing is accepted and speed-up = 1 / (1 + c k) measures verification's cost "
        "alone (least squares through the origin of 1 / speed-up - 1 against k). Output "
        "tok/s counts each request's prefill too; `TPOT speed-up` (mean time per output "
        "token after the first, off ÷ this run) is decoding's alone.\n\n"
    )


def _table(runs: list[Run], off: float, cost: float) -> str:
    head = (
        "| proposer | k | set A | output tok/s | mean TPOT ms | verifications | mean k | "
        "accepted ÷ proposed | measured a | tokens / verification | speed-up | "
        "TPOT speed-up | theory c=0 | theory fitted c | steps off |"
    )
    lines = [head, "|" + "---|" * 15]

    def tpot_of(label: str) -> float:
        return next((r.result.get("mean_tpot_ms", 0.0) for r in runs if r.label == label), 0.0)

    for r in runs:
        if r.error:
            lines.append(f"| {r.label} | {r.k} | - | did not start: {r.error} |" + " - |" * 11)
            continue
        c = r.counts
        a = r.acceptance
        theory = ("-", "-")
        if r.label in ("synthetic", "n-gram") and c.drafts:
            theory = (
                f"{theory_speedup(a, c.mean_k, 0.0):.2f}",
                f"{theory_speedup(a, c.mean_k, cost):.2f}",
            )
        cells = [
            r.label,
            str(r.k) if r.k else "-",
            f"{r.set_acceptance:g}" if r.set_acceptance is not None else "-",
            f"{r.tok_s:.1f}",
            f"{r.result.get('mean_tpot_ms', 0.0):.1f}",
            f"{c.drafts:.0f}",
            f"{c.mean_k:.2f}" if c.drafts else "-",
            f"{c.accepted_share:.3f}" if c.drafts else "-",
            f"{a:.3f}" if c.drafts else "-",
            f"{c.tokens_per_verification:.2f}" if c.drafts else "-",
            f"{speedup(r, runs):.2f}",
            f"{tpot_of(r.baseline) / r.result['mean_tpot_ms']:.2f}"
            if r.result.get("mean_tpot_ms")
            else "-",
            *theory,
            f"{c.steps_off:.0f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


REAL_MARKERS = {"n-gram": "*", "draft": "^", "draft int4": "D"}


def _plot(runs: list[Run], off: float, cost: float, path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    xs = np.linspace(0.0, 0.999, 200)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, k in enumerate(KS):
        color = colors[i % len(colors)]
        axes[0].plot(xs, [theory_speedup(a, k, 0.0) for a in xs], "--", color=color, lw=0.8)
        axes[0].plot(xs, [theory_speedup(a, k, cost) for a in xs], "-", color=color, label=f"k={k}")
        axes[1].plot(xs, [expected_tokens(a, k) for a in xs], "-", color=color, label=f"k={k}")
        mine = [r for r in runs if r.label == "synthetic" and r.k == k and r.counts.drafts]
        axes[0].plot([r.acceptance for r in mine], [r.tok_s / off for r in mine], "o", color=color)
        axes[1].plot(
            [r.set_acceptance for r in mine],
            [r.counts.tokens_per_verification for r in mine],
            "o",
            color=color,
        )
    for r in runs:
        if r.label in REAL_MARKERS and not r.error and r.counts.drafts:
            axes[0].plot(
                [r.acceptance],
                [speedup(r, runs)],
                REAL_MARKERS[r.label],
                color="black",
                markersize=9,
                label=f"{r.label} (mean k {r.counts.mean_k:.1f})",
            )
    axes[0].axhline(1.0, color="grey", lw=0.5)
    axes[0].set_xlabel("acceptance a (measured)")
    axes[0].set_title(f"speed-up over no speculation (solid: c={cost:.3f}; dashed: c=0)")
    axes[0].legend(fontsize=8)
    axes[1].set_xlabel("set acceptance A (synthetic)")
    axes[1].set_title("tokens per verification: measured (dots), (1-A^(k+1))/(1-A)")
    axes[1].legend(fontsize=8)
    fig.suptitle("E6: speculative decoding at concurrency 1")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _summary(runs: list[Run], off: float, cost: float) -> str:
    synthetic = [r for r in runs if r.label == "synthetic" and r.counts.drafts]
    best = max(synthetic, key=lambda r: r.tok_s)
    unaccepted = ", ".join(
        f"k={r.k}: {r.tok_s / off:.2f}×" for r in synthetic if r.set_acceptance == 0.0
    )
    per_k = ", ".join(
        f"{(off / r.tok_s - 1) / r.k:.3f}" for r in synthetic if r.set_acceptance == 0.0
    )
    text = (
        f"Computed from the table: without speculation {off:.1f} output tok/s. With nothing "
        f"accepted (A = 0) each step verifies k proposals for one token: {unaccepted}, so "
        f"one proposed token costs c = {cost:.3f} of a step (fitted; per k, "
        f"(1 / speed-up - 1) / k: {per_k}). The best synthetic run "
        f"is k={best.k}, A={best.set_acceptance:g}: {best.tok_s / off:.2f}× (theory at its "
        f"measured a = {best.acceptance:.3f}: {theory_speedup(best.acceptance, best.k, cost):.2f}"
        f"× with c fitted, {theory_speedup(best.acceptance, best.k, 0.0):.2f}× with c = 0).\n"
    )
    for r in runs:
        if r.label not in REAL_MARKERS:
            continue
        if r.error:
            text += f"\n- {r.label}: did not run ({r.error}).\n"
            continue
        text += (
            f"\n- {r.label}: measured a = {r.acceptance:.3f} (accepted ÷ proposed "
            f"{r.counts.accepted_share:.3f}, mean k {r.counts.mean_k:.2f}, "
            f"{r.counts.tokens_per_verification:.2f} tokens per verification), "
            f"{speedup(r, runs):.2f}× the run without speculation"
            + (" of the float target" if r.baseline != "off" else "")
            + ".\n"
        )
    return text
