"""E6's arithmetic: the counters read from /metrics, the acceptance they imply (checked
against verifications simulated by the synthetic proposer's rule), the theory's E and
the fitted proposal cost."""

from __future__ import annotations

import math

import numpy as np
import pytest
from cadence_bench.speculation import (
    SpecCounts,
    acceptance_of,
    expected_tokens,
    fit_proposal_cost,
    read_spec_counts,
    theory_speedup,
)
from cadence_bench.speculative_experiment import KS, MAX_STEP_TOKENS, plan_runs

# The router's exposition of the series (router/src/speculative/metrics.rs), after 10
# verifications of 4 proposals, 13 accepted.
EXPOSITION = """\
# HELP vllm:spec_decode_num_drafts_total Verifications: a request's step with proposed tokens.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{model_name="SmolLM2"} 10
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{model_name="SmolLM2"} 40
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{model_name="SmolLM2"} 13
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="SmolLM2",position="0"} 6
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="SmolLM2",position="1"} 4
cadence_spec_decode_steps_off_total{model="SmolLM2"} 2
"""


def test_counters_are_read_by_their_exact_names() -> None:
    c = read_spec_counts(EXPOSITION)
    assert c == SpecCounts(drafts=10, draft_tokens=40, accepted=13, steps_off=2)
    assert c.mean_k == 4 and c.tokens_per_verification == 2.3 and c.accepted_share == 13 / 40
    assert read_spec_counts("cadence_running_requests 0\n") == SpecCounts()
    assert c.since(SpecCounts(4, 16, 3, 2)) == SpecCounts(6, 24, 10, 0)


@pytest.mark.parametrize("k", [1, 3, 8])
def test_expected_tokens_is_the_mean_accepted_run_plus_one(k: int) -> None:
    for a in (0.0, 0.3, 0.75, 1.0):
        mean = sum((j + 1) * a**j * (1 - a) for j in range(k)) + (k + 1) * a**k
        assert expected_tokens(a, k) == pytest.approx(mean, abs=1e-12)


@pytest.mark.parametrize(("a", "k"), [(0.3, 1), (0.5, 4), (0.9, 8), (0.7, 2)])
def test_acceptance_of_recovers_the_synthetic_rate(a: float, k: int) -> None:
    # The synthetic rule: proposal j is accepted iff every earlier one was and u_j < A.
    n = 20_000
    u = np.random.default_rng(int(a * 100) + k).random((n, k))
    accepted = np.cumprod(u < a, axis=1).sum(axis=1)
    counts = SpecCounts(drafts=n, draft_tokens=n * k, accepted=float(accepted.sum()))
    got = acceptance_of(counts)
    # Delta method: sd(a_hat) = sd(accepted per draft) / sqrt(n) / dE/da.
    slope = (expected_tokens(a + 1e-6, k) - expected_tokens(a - 1e-6, k)) / 2e-6
    assert abs(got - a) < 5 * accepted.std() / math.sqrt(n) / slope
    # Exact counts invert exactly; all accepted is a = 1, none a = 0.
    exact = SpecCounts(1000, 1000 * k, 1000 * (expected_tokens(a, k) - 1))
    assert acceptance_of(exact) == pytest.approx(a, abs=1e-9)
    assert acceptance_of(SpecCounts(5, 5 * k, 5 * k)) == 1.0
    assert acceptance_of(SpecCounts(5, 5 * k, 0)) == pytest.approx(0.0, abs=1e-9)


def test_proposal_cost_is_fitted_from_unaccepted_runs() -> None:
    c = 0.07
    assert fit_proposal_cost({k: 1 / (1 + c * k) for k in KS}) == pytest.approx(c)
    assert theory_speedup(0.0, 4, c) == pytest.approx(1 / 1.28)
    assert theory_speedup(0.5, 2, 0.0) == pytest.approx(1.75)


def test_every_speculative_launch_keeps_the_load_switch_out_of_the_way() -> None:
    runs = plan_runs((0.0, 0.5), "/models/m", "/models/m-float32")
    assert runs[0].label == "off" and runs[0].flags == []
    assert [(r.k, r.set_acceptance) for r in runs if r.label == "synthetic"] == [
        (k, a) for k in KS for a in (0.0, 0.5)
    ]
    for r in runs[1:]:
        if r.label == "off float":
            assert "--speculative" not in r.flags
            continue
        at = r.flags.index("--speculative-max-step-tokens")
        assert int(r.flags[at + 1]) == MAX_STEP_TOKENS >= 1 + max(KS)
    draft, twin = [r for r in runs if r.label.startswith("draft")]
    assert draft.flags[draft.flags.index("--draft-model-id") + 1] == "/models/m"
    # the int4 twin drafts for the float copy, and is compared with it served alone
    assert twin.flags[twin.flags.index("--draft-model-id") + 1] == "/models/m-float32"
    assert twin.flags[twin.flags.index("--model-id") + 1] == "/models/m-float32"
    assert twin.flags[-2:] == ["--draft-quantize", "int4"] and twin.baseline == "off float"
    off_float = next(r for r in runs if r.label == "off float")
    assert off_float.flags == ["--model-id", "/models/m-float32", "--dtype", "bfloat16"]
