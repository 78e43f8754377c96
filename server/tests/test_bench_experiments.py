"""The experiments' records, resume, selection, step trace and rendering, without
launching a server: the launcher is replaced by a stand-in that answers every
configuration at once, and /metrics by a real sample of the router's text."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from cadence.cli import build_parser
from cadence_bench import e1_batching, e2_variance, e3_batch_size, e4_kv, e4_sharing, exp_runner
from cadence_bench.datasets import BenchRequest
from cadence_bench.exp_records import Record, RecordStore, fingerprint, from_json, to_json
from cadence_bench.exp_runner import Context, Measured, Planned, Progress, Scale, run_planned
from cadence_bench.kv import parse_metrics
from cadence_bench.step_trace import step_trace, time_shares

DATA = Path(__file__).parent / "data"
# /metrics of a launched router (embedded model), before and after two sequential
# requests of 8 tokens each; the warm-up request came before the first.
BEFORE = (DATA / "router_metrics_before.txt").read_text()
AFTER = (DATA / "router_metrics_after.txt").read_text()


class FakeServers(exp_runner.Servers):
    """Records which flags were launched instead of launching them."""

    def __init__(self) -> None:
        super().__init__()
        self.launched: list[list[str]] = []

    def get(self, flags: list[str], name: str) -> str:
        if self.flags != flags:
            self.launched.append(list(flags))
            self.flags = list(flags)
        return "http://stand-in"

    def up(self, flags: list[str]) -> bool:
        return self.flags == flags

    def close(self) -> None:
        self.flags = None


@pytest.fixture(autouse=True)
def canned_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each configuration's run reads /metrics twice: the sample before, then after."""
    texts = [BEFORE, AFTER]
    calls = {"n": 0}

    def read(url: str) -> dict[str, float]:
        calls["n"] += 1
        return parse_metrics(texts[(calls["n"] - 1) % 2])

    monkeypatch.setattr(exp_runner, "read_metrics", read)


def _context(tmp: Path, scale: Scale | None = None, **store: Any) -> Context:
    return Context(
        name="E1",
        scale=scale or Scale(div=16, num_prompts=8, rates=(1.0, 4.0)),
        scale_name="small --length-divisor 16 --num-prompts 8",
        out=tmp,
        server_args=["--block-size", "16"],
        store=RecordStore(tmp, "E1", **store),
        servers=FakeServers(),
        progress=Progress("E1", 3),
    )


def _item(slug: str, measured: list[str], rate: float = math.inf) -> Planned:
    def measure(url: str) -> Measured:
        measured.append(slug)
        return Measured({"output_throughput": 10.0, "request_throughput": 1.0}, [0.5, 0.7])

    return Planned(
        slug=slug,
        label=slug,
        config={"name": slug},
        flags=["--batching", slug.split("-")[0]],
        requests=2,
        measure=measure,
        determinants={"rate": rate},
    )


def test_record_round_trips_through_json_with_an_infinite_rate() -> None:
    record = Record(
        experiment="E1",
        slug="continuous-all-at-once",
        config={"batching": "continuous", "requests": 200},
        result={"output_throughput": 231.0, "completed": 200},
        latencies=[0.25, 1.5],
        trace={"steps": 12.0, "mean_step_ms": 40.5},
        extras={"series": [[0.0, 0.5, 0.4, 64.0, 80.0]]},
        determinants={"rate": math.inf, "outputs": (32, 64)},
        fingerprint=fingerprint({"rate": math.inf}),
        measured_at="2026-11-28T18:00:00Z",
    )
    back = from_json(to_json(record))
    assert back.config == record.config and back.result == record.result
    assert back.latencies == record.latencies and back.trace == record.trace
    assert back.extras == record.extras and back.fingerprint == record.fingerprint
    assert back.determinants == {"rate": "inf", "outputs": [32, 64]}


def test_fingerprint_ignores_key_order_and_sees_every_value() -> None:
    a = fingerprint({"rate": 1.5, "flags": ["--batching", "static"], "seed": 0})
    assert a == fingerprint({"seed": 0, "flags": ["--batching", "static"], "rate": 1.5})
    assert a != fingerprint({"rate": 1.6, "flags": ["--batching", "static"], "seed": 0})
    assert a != fingerprint({"rate": 1.5, "flags": ["--batching", "dynamic"], "seed": 0})


def test_a_second_run_measures_nothing_and_a_changed_setting_measures_again(
    tmp_path: Path,
) -> None:
    measured: list[str] = []
    items = [_item("continuous-a", measured), _item("static-a", measured)]
    ctx = _context(tmp_path)
    first = run_planned(ctx, items)
    assert measured == ["continuous-a", "static-a"]
    assert (tmp_path / "records" / "E1" / "static-a.json").is_file()
    assert first["static-a"].trace["steps"] == 16

    again = _context(tmp_path)
    second = run_planned(again, items)
    assert measured == ["continuous-a", "static-a"]  # nothing measured twice
    assert again.servers.launched == []  # nothing launched either
    assert second["static-a"].fingerprint == first["static-a"].fingerprint

    changed = [items[0], _item("static-a", measured, rate=2.0)]
    run_planned(_context(tmp_path), changed)
    assert measured == ["continuous-a", "static-a", "static-a"]

    run_planned(_context(tmp_path, fresh=True), changed)
    assert measured[3:] == ["continuous-a", "static-a"]


def test_only_measures_the_selected_slugs_and_keeps_the_others_records(tmp_path: Path) -> None:
    measured: list[str] = []
    items = [_item("continuous-a", measured), _item("static-a", measured)]
    run_planned(_context(tmp_path, only=("static",)), items)
    assert measured == ["static-a"]
    records = run_planned(_context(tmp_path, only=("continuous",)), items)
    assert measured == ["static-a", "continuous-a"]
    assert set(records) == {"continuous-a", "static-a"}


def test_report_only_measures_nothing(tmp_path: Path) -> None:
    measured: list[str] = []
    ctx = _context(tmp_path)
    ctx.report_only = True
    assert run_planned(ctx, [_item("continuous-a", measured)]) == {}
    assert measured == [] and ctx.servers.launched == []


def test_configurations_sharing_flags_share_one_launch(tmp_path: Path) -> None:
    measured: list[str] = []
    ctx = _context(tmp_path)
    run_planned(ctx, [_item("static-a", measured), _item("static-b", measured)])
    assert ctx.servers.launched == [["--batching", "static"]]


def test_step_trace_from_two_router_metrics_texts() -> None:
    trace = step_trace(parse_metrics(BEFORE), parse_metrics(AFTER))
    # the fixture: 2 → 18 steps, 5 → 28 step tokens, batch size sum 2 → 18
    assert trace["steps"] == 16
    assert trace["tokens_per_step"] == pytest.approx(23 / 16)
    assert trace["requests_per_step"] == pytest.approx(1.0)
    assert trace["mean_step_ms"] == pytest.approx((7.14773974 - 4.093636311) / 16 * 1000)
    assert trace["mean_forward_ms"] == pytest.approx((7.075771198 - 4.083646392) / 16 * 1000)
    assert trace["preemptions"] == 0
    preempted = AFTER.replace('kind="swap"} 0', 'kind="swap"} 3').replace(
        'kind="recompute"} 0', 'kind="recompute"} 2'
    )
    assert step_trace(parse_metrics(BEFORE), parse_metrics(preempted))["preemptions"] == 5


def test_step_trace_of_an_idle_router_is_zero_not_a_division_error() -> None:
    trace = step_trace(parse_metrics(AFTER), parse_metrics(AFTER))
    assert trace["steps"] == 0 and trace["mean_step_ms"] == 0 and trace["tokens_per_step"] == 0


def test_time_shares_split_a_run_around_the_forward() -> None:
    trace = step_trace(parse_metrics(BEFORE), parse_metrics(AFTER))
    steps, forward = 7.14773974 - 4.093636311, 7.075771198 - 4.083646392
    shares = time_shares(trace, duration_s=4.0)
    assert shares["outside_forward_of_steps"] == pytest.approx(1 - forward / steps)
    assert shares["outside_forward_of_run"] == pytest.approx(1 - forward / 4.0)
    # the run holds its steps and what lies between them
    assert shares["outside_forward_of_run"] > shares["outside_forward_of_steps"]
    assert time_shares(step_trace(parse_metrics(AFTER), parse_metrics(AFTER)), 4.0) == {}
    assert time_shares(trace, 0.0) == {}


def test_saturation_relative_rates() -> None:
    assert e1_batching.saturation_rates(2.0) == pytest.approx([1.0, 1.8, 3.0])
    with pytest.raises(ValueError):
        e1_batching.saturation_rates(0.0)


def _fake_measure(monkeypatch: pytest.MonkeyPatch, seen: list[tuple[int, float]]) -> None:
    def measure(url: str, reqs: list[Any], rate: float, seed: int = 0) -> Measured:
        seen.append((len(reqs), rate))
        result = {
            "output_throughput": 100.0 if math.isinf(rate) else 50.0 * rate,
            "request_throughput": 2.0,
            "mean_tpot_ms": 20.0,
        }
        return Measured(result, [0.1 * i for i in range(len(reqs))])

    monkeypatch.setattr(e1_batching, "measure_requests", measure)


def test_e1_measures_saturation_first_then_the_same_rates_for_every_mode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: list[tuple[int, float]] = []
    _fake_measure(monkeypatch, seen)
    ctx = _context(tmp_path)
    e1_batching.run(ctx, none_prompts=3)
    lines = capsys.readouterr().err.splitlines()
    assert lines[:2] == [
        "[E1 1/16] continuous, all at once: launching",
        "[E1 1/16] continuous, all at once: measuring 8 requests",
    ]
    assert lines[2].startswith("[E1 1/16] continuous, all at once: done in 0 s (output 100.0")
    assert "[E1 16/16] none, Poisson 3/s (1.5× saturation): measuring 3 requests" in lines
    assert seen[0] == (8, math.inf)  # continuous, all at once: the saturation run
    assert len(seen) == 16
    rates = {rate for _, rate in seen if not math.isinf(rate)}
    assert sorted(rates) == pytest.approx([1.0, 1.8, 3.0])  # 0.5/0.9/1.5 × 2 req/s
    assert [n for n, _ in seen[-4:]] == [3, 3, 3, 3]  # `none` gets its own count
    text = (tmp_path / "E1.md").read_text()
    assert "Not measured yet" not in text
    assert "saturation rate 2 requests/s" in text
    assert "### none" in text and (tmp_path / "E1-throughput.png").is_file()

    seen.clear()
    e1_batching.run(_context(tmp_path), none_prompts=3)
    assert seen == []  # resumed: everything recorded
    assert "[E1 5/16] dynamic, all at once: recorded in " in capsys.readouterr().err


def test_e1_patterns_draw_their_own_prompts_the_same_for_every_mode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mode's patterns share one launch: a later pattern must not meet an earlier one's
    prompts in the prefix cache, and the modes must compare on the same prompts."""
    prompts: list[str] = []

    def measure(url: str, reqs: list[Any], rate: float, seed: int = 0) -> Measured:
        prompts.append(reqs[0].prompt)
        result = {"output_throughput": 1.0, "request_throughput": 2.0, "mean_tpot_ms": 20.0}
        return Measured(result, [0.1] * len(reqs))

    monkeypatch.setattr(e1_batching, "measure_requests", measure)
    e1_batching.run(_context(tmp_path), none_prompts=3)
    by_mode = [prompts[i : i + 4] for i in range(0, 16, 4)]  # all at once, 0.5×, 0.9×, 1.5×
    assert len(set(by_mode[0])) == 4
    assert all(patterns == by_mode[0] for patterns in by_mode)


def test_e1_report_lists_what_is_not_measured_yet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[int, float]] = []
    _fake_measure(monkeypatch, seen)
    e1_batching.run(_context(tmp_path, only=("dynamic",)), none_prompts=3)
    assert seen == [(8, math.inf)]  # without the saturation run no Poisson rate exists
    text = (tmp_path / "E1.md").read_text()
    assert "Not measured yet" in text and "continuous, all at once" in text
    assert "dynamic, Poisson at 0.9× saturation" in text
    assert "- all at once: dynamic 100.0 output tok/s" in text

    ctx = _context(tmp_path)
    ctx.report_only = True
    (tmp_path / "E1.md").unlink()
    e1_batching.run(ctx, none_prompts=3)
    assert seen == [(8, math.inf)]
    assert "dynamic" in (tmp_path / "E1.md").read_text()


def test_e1_summary_checks_the_documents_ordering() -> None:
    def rec(mode: str, tput: float) -> Record:
        return Record("E1", mode, {"batching": mode, "arrivals": "x"}, {"output_throughput": tput})

    good = [rec("continuous", 4), rec("dynamic", 3), rec("static", 2), rec("none", 1)]
    assert "none holds" in e1_batching.summary(good)
    bad = [rec("continuous", 3), rec("dynamic", 4), rec("static", 2), rec("none", 1)]
    assert "does not hold" in e1_batching.summary(bad)
    assert "dynamic 4.0 > continuous 3.0" in e1_batching.summary(bad)


def test_e4_renders_with_the_sharing_runs_missing(tmp_path: Path) -> None:
    ctx = _context(tmp_path)
    ctx.name = "E4"
    series = [[0.1, 0.9, 0.5, 160.0, 300.0], [0.2, 0.8, 0.6, 176.0, 300.0]]
    paged = Record(
        "E4",
        e4_kv.PAGED_SLUG,
        {"run": "paged vs contiguous"},
        {"output_throughput": 50.0},
        extras={"series": series},
    )
    samples = {
        f"samples-n{n}": Record(
            "E4",
            f"samples-n{n}",
            {"kind": "samples", "width": n},
            {"duration_s": 2.0},
            extras={"peak_blocks_used": 10 + 4 * n},
        )
        for n in (1, 2)
    }
    items = [
        Planned(slug, slug, {}, [], 1, lambda url: Measured({}))
        for slug in [e4_kv.PAGED_SLUG, "samples-n1", "samples-n2", "beams-w2"]
    ]
    e4_kv.render(ctx, items, {e4_kv.PAGED_SLUG: paged, **samples}, [32, 64], 16, 32, 8)
    text = (tmp_path / "E4.md").read_text()
    assert "| samples | 2 | 18 | - | 28 | 36% |" in text  # 2 × 14 unshared, 18 measured
    assert "Not measured yet (no record with this command's settings): beams-w2" in text
    assert "1.79× the slots" in text  # 300 ÷ mean(160, 176) = 300 ÷ 168


def test_experiment_flags_parse() -> None:
    args = build_parser().parse_args(
        ["bench", "experiment", "E1", "--only", "static", "--only", "none-poisson", "--fresh"]
    )
    assert args.only == ["static", "none-poisson"] and args.fresh and not args.report_only
    assert build_parser().parse_args(["bench", "experiment", "E4", "--report-only"]).report_only


def test_analytic_blocks_of_samples_and_beams() -> None:
    # 32-token prompt (2 full blocks of 16), 8 tokens each: 3 blocks per sequence alone
    assert e4_sharing.analytic_blocks("beams", 32, 8, 8, 16) == (2 + 8 * 1, 8 * 3)
    # samples recompute the last prompt token into a copy of its block: one block fewer
    # shared when the prompt ends on a block boundary
    assert e4_sharing.analytic_blocks("samples", 32, 8, 8, 16) == (1 + 8 * 2, 8 * 3)
    assert e4_sharing.analytic_blocks("samples", 40, 8, 4, 16) == (2 + 4 * 1, 4 * 3)
    assert e4_sharing.analytic_blocks("samples", 32, 8, 1, 16) == (3, 3)


def _record(slug: str, config: dict[str, Any], tput: float, **extras: Any) -> Record:
    result = {"output_throughput": tput, "mean_tpot_ms": 10.0, "duration_s": 1.0}
    return Record("E", slug, config, result, latencies=[0.5, 1.0], extras=extras)


def test_e2_renders_with_one_mode_measured(tmp_path: Path) -> None:
    ctx = _context(tmp_path)
    ctx.name = "E2"
    by_cap = {c: [BenchRequest("p", 32, 1)] for c in (2, 8)}
    by_rate = {rate: [BenchRequest("q", 32, 1)] for rate in ctx.scale.rates}
    items = e2_variance.plan(ctx, by_cap, by_rate, 8)
    records = {
        "continuous-cap2": _record("continuous-cap2", {"batching": "continuous", "cap": 2}, 4.0),
        "static-cap2": _record("static-cap2", {"batching": "static", "cap": 2}, 2.0),
        "continuous-poisson-1": _record(
            "continuous-poisson-1", {"batching": "continuous", "cap": 8, "rate": 1.0}, 3.0
        ),
    }
    e2_variance.render(ctx, items, records, [2, 8], 8.0, 32)
    text = (tmp_path / "E2.md").read_text()
    assert "by cap: 2: 2.00×." in text  # cap 8 is measured in neither mode
    assert "static, cap 8, all at once" in text.split("Not measured yet")[1]
    assert (tmp_path / "E2-variance.png").is_file()


def test_e2_rates_draw_their_own_prompts_with_the_cdf_caps_lengths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mode's caps and rates share one launch: a rate must not meet the caps' prompts in
    the prefix cache; it keeps the CDF cap's output lengths, and both modes see the same."""
    seen: list[list[Any]] = []

    def measure(url: str, reqs: list[Any], rate: float, seed: int = 0) -> Measured:
        seen.append(reqs)
        return Measured({"output_throughput": 1.0, "mean_tpot_ms": 20.0}, [0.1] * len(reqs))

    monkeypatch.setattr(e2_variance, "measure_requests", measure)
    ctx = _context(tmp_path)
    ctx.name = "E2"
    e2_variance.run(ctx)
    per_mode = len(e2_variance.CAPS) + len(ctx.scale.rates)
    continuous, static = seen[:per_mode], seen[per_mode:]
    assert [[r.prompt for r in reqs] for reqs in continuous] == [
        [r.prompt for r in reqs] for reqs in static
    ]
    caps, rates = continuous[: len(e2_variance.CAPS)], continuous[len(e2_variance.CAPS) :]
    cap_prompts = {r.prompt for reqs in caps for r in reqs}
    for reqs in rates:
        assert not cap_prompts & {r.prompt for r in reqs}
        assert [r.output_len for r in reqs] == [r.output_len for r in caps[e2_variance.CDF_CAP]]


def test_e3_renders_the_sweep_without_the_replicas(tmp_path: Path) -> None:
    ctx = _context(tmp_path)
    ctx.name = "E3"
    requests = [BenchRequest("p", 16, 8)]
    items = e3_batch_size.plan(ctx, requests)
    columns = {"KV blocks": 100, "fit at full length": 50, "peak running": 2, "preemptions": 0}
    records = {
        f"batch-{b}": _record(
            f"batch-{b}", {"max batch size": b, "KV cache": "default", **columns}, 10.0 * b
        )
        for b in (1, 2)
    }
    e3_batch_size.render(ctx, items, records, 16, 8)
    text = (tmp_path / "E3.md").read_text()
    assert "relative to batch size 1: 1: 1.00×, 2: 2.00×" in text
    largest = max(e3_batch_size.BATCH_SIZES)
    budget = e3_batch_size.kv_budget(16)
    assert f"max batch size {largest}, KV cache {budget}" in text.split("Not measured yet")[1]
    # about 7 requests at full length at every scale: 64 MiB at full length, 8 at / 8
    assert (e3_batch_size.kv_budget(1), e3_batch_size.kv_budget(8)) == ("64MiB", "8MiB")


def test_a_record_that_lost_requests_is_measured_again(tmp_path: Path) -> None:
    store = RecordStore(tmp_path, "E1")
    print_ = fingerprint({"rate": 1.0})
    for slug, failed in (("kept", 0), ("lost", 72)):
        record = _record(slug, {"mode": slug}, 1.0)
        record.result["failed"], record.fingerprint = failed, print_
        store.save(record)
    assert store.reusable("kept", print_) is not None
    assert store.reusable("lost", print_) is None


def test_a_run_with_a_failed_request_records_nothing() -> None:
    from cadence_bench.metrics import RequestOutput

    served = [RequestOutput(True, 8, 4), RequestOutput(True, 8, 4)]
    exp_runner.every_one_served(served)
    with pytest.raises(RuntimeError, match="1 of 3 requests failed.*429"):
        exp_runner.every_one_served([*served, RequestOutput(False, 8, error="HTTP 429")])


def test_e6_records_each_launch_resumes_and_reports_a_proposer_that_cannot_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cadence_bench import speculative_experiment as e6

    measured: list[list[str]] = []
    servers = FakeServers()

    def launched(flags: list[str], name: str) -> str:
        if "--draft-quantize" in flags:
            raise RuntimeError("cadence launch exited: see /no/such/log")
        return FakeServers.get(servers, flags, name)

    def one_at_a_time(url: str, requests: list[Any]) -> Measured:
        flags = servers.flags or []
        measured.append(flags)
        k = (
            int(flags[flags.index("--num-speculative-tokens") + 1])
            if "--speculative" in flags
            else 0
        )
        a = (
            float(flags[flags.index("--speculative-acceptance") + 1])
            if "synthetic" in flags
            else 0.5
        )
        counts = {"drafts": 10.0 * bool(k), "draft_tokens": 10.0 * k, "accepted": 10.0 * k * a}
        result = {"output_throughput": 100.0 / (1 + 0.05 * k) * (1 + a * k), "mean_tpot_ms": 9.0}
        return Measured(result, [1.0] * len(requests), extras={"counts": counts})

    monkeypatch.setattr(servers, "get", launched)
    monkeypatch.setattr(e6, "_one_at_a_time", one_at_a_time)
    monkeypatch.setattr(e6, "_served_folder", lambda args: "/models/m")
    monkeypatch.setattr(e6, "_float_copy", lambda folder: "/models/m-float32")

    def context() -> Context:
        ctx = _context(tmp_path, Scale(div=4, num_prompts=12, rates=(1.0,)))
        ctx.name, ctx.store, ctx.servers = "E6", RecordStore(tmp_path, "E6"), servers
        return ctx

    e6.run(context())
    runs = e6.plan_runs(e6.ACCEPTANCES["small"], "/models/m", "/models/m-float32")
    assert len(measured) == len(runs) - 1  # the int4 twin could not start
    slugs = {p.stem for p in (tmp_path / "records" / "E6").glob("*.json")}
    assert "off" in slugs and "synthetic-k4-a0.5" in slugs and "draft-int4-k4" not in slugs
    text = (tmp_path / "E6.md").read_text()
    assert "| draft int4 | 4 | - | did not start: cadence launch exited" in text
    assert "| synthetic | 2 | 0.5 | 181.8 |" in text  # 100 / 1.1 × (1 + 0.5 × 2), its record

    measured.clear()
    e6.run(context())
    assert measured == []  # resumed: every launch that ran is recorded
    assert (tmp_path / "E6.md").read_text().split("The machine's")[0] == text.split(
        "The machine's"
    )[0]
