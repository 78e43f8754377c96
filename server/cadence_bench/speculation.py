"""Speculative decoding's arithmetic for E6: the counters a server exports, the acceptance
rate they imply, and the speed-up theory predicts from it.

A proposal is accepted with probability a given that the ones before it were (the first
rejection ends the run), so one verification of k proposals yields
E = 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a) tokens. A step verifying k proposals
costs (1 + c k) plain decode steps, c being one proposed token's cost relative to a step
(its share of the forward, plus proposing it), so speculation speeds decoding up by
E / (1 + c k).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# vLLM's names, which cadence's router exports unchanged (router/src/speculative/metrics.rs).
DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
STEPS_OFF = "cadence_spec_decode_steps_off_total"


@dataclass(frozen=True, slots=True)
class SpecCounts:
    """The speculative counters at one moment, or their growth over a run."""

    drafts: float = 0.0  # verifications: a request's step with proposals
    draft_tokens: float = 0.0  # proposed tokens
    accepted: float = 0.0  # accepted proposed tokens
    steps_off: float = 0.0  # steps the load switch left proposals out of

    def since(self, before: SpecCounts) -> SpecCounts:
        return SpecCounts(
            self.drafts - before.drafts,
            self.draft_tokens - before.draft_tokens,
            self.accepted - before.accepted,
            self.steps_off - before.steps_off,
        )

    @property
    def mean_k(self) -> float:
        """Proposals per verification."""
        return self.draft_tokens / self.drafts if self.drafts else 0.0

    @property
    def tokens_per_verification(self) -> float:
        """1 + accepted proposals per verification: the measured E."""
        return 1.0 + self.accepted / self.drafts if self.drafts else 1.0

    @property
    def accepted_share(self) -> float:
        """Accepted ÷ proposed tokens: vLLM's 'acceptance rate' (which depends on k)."""
        return self.accepted / self.draft_tokens if self.draft_tokens else 0.0


def _sample(text: str, name: str) -> float:
    """The sum of `name`'s samples in a Prometheus text exposition (0 when absent)."""
    pattern = rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$"
    return sum(float(v) for v in re.findall(pattern, text, re.M))


def read_spec_counts(metrics_text: str) -> SpecCounts:
    names = (DRAFTS, DRAFT_TOKENS, ACCEPTED, STEPS_OFF)
    return SpecCounts(*(_sample(metrics_text, n) for n in names))


def expected_tokens(a: float, k: float) -> float:
    """E = 1 + a + ... + a^k (k may be a mean, not whole)."""
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1.0)) / (1.0 - a)


def theory_speedup(a: float, k: float, cost: float) -> float:
    return expected_tokens(a, k) / (1.0 + cost * k)


def acceptance_of(counts: SpecCounts) -> float:
    """The a whose E at the run's mean k equals the measured tokens per verification
    (E grows with a, so bisection finds it); the per-proposal acceptance the theory
    uses, whatever k each verification had."""
    k, target = counts.mean_k, counts.tokens_per_verification
    if k <= 0:
        return 0.0
    if target >= k + 1.0:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        if expected_tokens(mid, k) < target:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def fit_proposal_cost(speedup_unaccepted: dict[int, float]) -> float:
    """c from runs where nothing is accepted (E = 1, so speed-up = 1 / (1 + c k)): the
    least-squares slope of 1 / speed-up - 1 against k, through the origin."""
    ks = list(speedup_unaccepted)
    num = sum(k * (1.0 / speedup_unaccepted[k] - 1.0) for k in ks)
    den = sum(k * k for k in ks)
    return num / den if den else 0.0
