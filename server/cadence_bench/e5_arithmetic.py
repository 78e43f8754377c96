"""E5's arithmetic, apart from any measuring: the merged-copy baseline composed from
measured parts, ratios to the base model, and the goal check.

A merged deployment serves each adapter's requests on that adapter's own copy of the
model, one copy at a time on one machine: adapter i's c_i requests take T(c_i), the time
a merged copy takes to serve c_i such requests at the concurrency they allow (all of
them, up to the workload's cap), and every copy that serves anything is loaded once
(the switch cost s). Over the adapters with requests:

    merged output tok/s = Σ tokens(c_i) / (Σ T(c_i) + n_used · s)

T depends only on c (the requests have fixed lengths and every copy has the base
model's shapes), so one copy measured at each share size present gives every term.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# The goal E5 reports against: with this many adapters or more, LoRA serving keeps at
# least this share of the base model's output throughput.
GOAL_MIN_ADAPTERS = 64
GOAL_SHARE = 0.8


@dataclass(frozen=True, slots=True)
class ShareTime:
    """One merged copy serving `requests` requests: wall time and tokens generated."""

    requests: int
    duration_s: float
    output_tokens: int


@dataclass(frozen=True, slots=True)
class MergedEstimate:
    output_tokens: int
    serving_s: float  # Σ T(c_i)
    copies: int  # adapters with at least one request: one load each
    switch_s: float  # one copy's load

    @property
    def total_s(self) -> float:
        return self.serving_s + self.copies * self.switch_s

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.total_s if self.total_s > 0 else 0.0


def share_sizes(counts: Iterable[int]) -> list[int]:
    """The distinct non-zero requests-per-adapter of a workload, ascending: the share
    sizes a merged copy has to be measured at."""
    return sorted({c for c in counts if c > 0})


def compose_merged(
    counts: Iterable[int], shares: dict[int, ShareTime], switch_s: float
) -> MergedEstimate:
    """The merged deployment's totals for a workload with these requests per adapter,
    from the measured share times and one copy's load time."""
    used = [c for c in counts if c > 0]
    missing = sorted(set(used) - set(shares))
    if missing:
        raise ValueError(f"no measured share time for {missing} requests")
    return MergedEstimate(
        output_tokens=sum(shares[c].output_tokens for c in used),
        serving_s=sum(shares[c].duration_s for c in used),
        copies=len(used),
        switch_s=switch_s,
    )


def ratio(value: float, base: float) -> float:
    """value ÷ base; 0 when there is no base to divide by."""
    return value / base if base > 0 else 0.0


@dataclass(frozen=True, slots=True)
class GoalCheck:
    num_adapters: int
    share_of_base: float

    @property
    def met(self) -> bool:
        return self.share_of_base >= GOAL_SHARE


def goal_checks(lora_tok_s: dict[int, float], base_tok_s: float) -> list[GoalCheck]:
    """For every measured adapter count at or above the goal's, LoRA's share of the base
    model's output throughput."""
    return [
        GoalCheck(n, ratio(tok_s, base_tok_s))
        for n, tok_s in sorted(lora_tok_s.items())
        if n >= GOAL_MIN_ADAPTERS
    ]
