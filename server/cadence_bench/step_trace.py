"""The router's step trace over one measured run: /metrics read before and after it, and
the deltas of its step series. Two runs that disagree in throughput on the same workload
differ here in how many steps they took, how many tokens and requests each step carried
and how long a step took: the explanation a result table alone does not give."""

from __future__ import annotations

import httpx

from cadence_bench.kv import parse_metrics

# Prometheus series the trace reads (histograms as their _count and _sum).
STEPS = "cadence_step_duration_seconds_count"
STEP_SECONDS = "cadence_step_duration_seconds_sum"
FORWARDS = "cadence_forward_duration_seconds_count"
FORWARD_SECONDS = "cadence_forward_duration_seconds_sum"
STEP_TOKENS = "cadence_step_tokens_total"
BATCHES = "cadence_batch_size_count"
BATCH_REQUESTS = "cadence_batch_size_sum"
PREEMPTIONS = "cadence_preemptions_total"  # summed over its kinds by parse_metrics

# (column title, key) of the trace table in every experiment's report.
TRACE_COLUMNS = [
    ("steps", "steps"),
    ("mean step ms", "mean_step_ms"),
    ("mean forward ms", "mean_forward_ms"),
    ("tokens/step", "tokens_per_step"),
    ("requests/step", "requests_per_step"),
    ("preemptions", "preemptions"),
]


def read_metrics(url: str) -> dict[str, float]:
    """The router's /metrics as {series: value}, label sets summed."""
    return parse_metrics(httpx.get(f"{url.rstrip('/')}/metrics", timeout=30).text)


def _per(total: float, count: float) -> float:
    return total / count if count > 0 else 0.0


def step_trace(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What the router did between two /metrics readings: steps, mean step and forward
    time (ms), tokens computed and requests per step, preemptions."""

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    steps = delta(STEPS)
    return {
        "steps": steps,
        "mean_step_ms": 1000.0 * _per(delta(STEP_SECONDS), steps),
        "mean_forward_ms": 1000.0 * _per(delta(FORWARD_SECONDS), delta(FORWARDS)),
        "tokens_per_step": _per(delta(STEP_TOKENS), steps),
        "requests_per_step": _per(delta(BATCH_REQUESTS), delta(BATCHES)),
        "preemptions": delta(PREEMPTIONS),
        "step_seconds": delta(STEP_SECONDS),
        "forward_seconds": delta(FORWARD_SECONDS),
    }


def time_shares(trace: dict[str, float], duration_s: float) -> dict[str, float]:
    """Where a run's time went besides the shard's forward, as fractions (the charter's
    "router + gRPC under 3% of a step"): of the steps' time (from the router's send, or
    the previous step's answer when it was sent ahead, to its answer), what lies outside
    the forward (gRPC both ways, the shard's diff and answer, the hand-offs between
    threads); and of the run, what lies outside the forward altogether (that, plus the
    loop's scheduling and applying between steps when the shard waits for it). Steps do
    not overlap, so the run's share is at least the steps'. Empty without steps or a
    duration."""
    steps, forward = trace.get("step_seconds", 0.0), trace.get("forward_seconds", 0.0)
    if steps <= 0 or duration_s <= 0:
        return {}
    return {
        "outside_forward_of_steps": 1.0 - forward / steps,
        "outside_forward_of_run": 1.0 - forward / duration_s,
    }
