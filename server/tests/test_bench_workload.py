"""`cadence bench`'s arrival processes and datasets: moments within statistical bounds
over many draws, prompts of exactly the asked token length."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from cadence_bench.arrivals import arrival_gaps
from cadence_bench.datasets import (
    SHAREGPT_MEAN_INPUT,
    _lognormal,
    capped_exponential,
    jsonl_dataset,
    load_tokenizer,
    random_dataset,
)

N = 50_000


def test_all_at_once() -> None:
    assert arrival_gaps(5, float("inf")) == [0.0] * 5


@pytest.mark.parametrize("rate", [0.5, 4.0])
def test_poisson_gaps_are_exponential(rate: float) -> None:
    gaps = np.array(arrival_gaps(N, rate, seed=1))
    mean, var = 1 / rate, 1 / rate**2
    # Exponential: sd of the sample mean is mean/sqrt(N); of the sample variance,
    # sqrt(8) var / sqrt(N) (fourth central moment 9 mean^4). Five sigmas each.
    assert abs(gaps.mean() - mean) < 5 * mean / math.sqrt(N)
    assert abs(gaps.var() - var) < 5 * math.sqrt(8) * var / math.sqrt(N)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_gaps_keep_the_rate_and_scale_the_variance(burstiness: float) -> None:
    rate = 2.0
    gaps = np.array(arrival_gaps(N, rate, burstiness, seed=2))
    mean = 1 / rate
    var = mean**2 / burstiness  # Gamma(k, 1/(rate k)): variance k θ² = mean² / k
    sd_mean = math.sqrt(var / N)
    # Sample variance: Var(s²) ≈ (μ4 - σ⁴)/N with μ4 = σ⁴ (3 + 6/k).
    sd_var = var * math.sqrt((2 + 6 / burstiness) / N)
    assert abs(gaps.mean() - mean) < 5 * sd_mean
    assert abs(gaps.var() - var) < 5 * sd_var


def test_bad_rates_are_refused() -> None:
    with pytest.raises(ValueError, match="rate"):
        arrival_gaps(3, 0.0)
    with pytest.raises(ValueError, match="burstiness"):
        arrival_gaps(3, 1.0, burstiness=0.0)


@pytest.mark.parametrize("cap", [32, 128, 512])
def test_capped_exponential_is_a_truncated_exponential(cap: int) -> None:
    mean = 128.0
    xs = np.array(capped_exponential(N, cap, np.random.default_rng(3), mean))
    assert xs.min() >= 1 and xs.max() <= cap
    # E[X | X <= c] for X ~ Exp(mean): mean - c e^(-c/mean) / (1 - e^(-c/mean)).
    q = math.exp(-cap / mean)
    expected = mean - cap * q / (1 - q)
    # Rounding to whole tokens moves the mean by far less than a token.
    assert abs(xs.mean() - expected) < 5 * xs.std() / math.sqrt(N) + 0.5


def test_sharegpt_like_lengths_have_the_published_mean() -> None:
    xs = np.array(_lognormal(SHAREGPT_MEAN_INPUT, N, 10**9, np.random.default_rng(4)))
    # Log-normal, sigma 1: sd = mean sqrt(e - 1); clamping below 4 adds a little.
    sd = SHAREGPT_MEAN_INPUT * math.sqrt(math.e - 1)
    assert abs(xs.mean() - SHAREGPT_MEAN_INPUT) < 5 * sd / math.sqrt(N) + 0.5


def test_random_prompts_have_exact_token_lengths_and_distinct_starts() -> None:
    tok = load_tokenizer(None)
    reqs = random_dataset(tok, 40, (1, 400), (8, 16), seed=5)
    for r in reqs:
        assert len(tok.encode(r.prompt, add_special_tokens=False).ids) == r.prompt_len
        assert 8 <= r.output_len <= 16
    # Numbered, so no two share a prefix the server could cache (from 8 tokens up).
    numbered = [r.prompt.split()[0] for r in reqs if r.prompt_len >= 8]
    assert len(set(numbered)) == len(numbered) > 30
    assert len({r.prompt_len for r in reqs}) > 20  # ranged, not fixed


def test_jsonl_dataset(tmp_path: Path) -> None:
    tok = load_tokenizer(None)
    path = tmp_path / "w.jsonl"
    rows = [{"prompt": "The river ran fast.", "output_len": 7}, {"prompt": "Hi", "max_tokens": 3}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    reqs = jsonl_dataset(tok, str(path))
    assert [r.output_len for r in reqs] == [7, 3]
    assert reqs[0].prompt_len == len(tok.encode("The river ran fast.", add_special_tokens=False))
    path.write_text('{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match="prompt"):
        jsonl_dataset(tok, str(path))
