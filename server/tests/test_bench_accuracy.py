"""`cadence bench accuracy` drives an engine the way the router does: in float32 it must
reproduce transformers (the reference) exactly, so whatever a format loses is the format's."""

from __future__ import annotations

import pytest
import torch
from cadence_bench.accuracy import Variant, compare, divergence, measure


def test_float32_engine_matches_the_reference_teacher_forced_and_greedy(model_dirs) -> None:
    path = model_dirs("llama_gqa")
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(3, 256, (300,), generator=g).tolist()  # > one 256-token chunk
    prompts = [tokens[:20], tokens[100:117]]
    rows = measure(path, path, path, [Variant("float32")], tokens, prompts, generate=12)
    ref, got = rows
    assert got["top1_agreement"] == 1.0
    assert got["max_abs_delta_logit"] < 1e-3
    assert abs(got["perplexity"] - ref["perplexity"]) < 1e-3 * ref["perplexity"]
    assert got["greedy_identical_tokens_min"] == 12


def test_compare_and_divergence_count_what_they_name() -> None:
    ref = torch.tensor([[0.0, 1.0], [2.0, 0.0], [0.0, 3.0]])
    got = torch.tensor([[0.0, 1.5], [0.0, 2.0], [0.0, 3.0]])
    row = compare(ref, got, [1, 1, 1])
    assert row["top1_agreement"] == pytest.approx(2 / 3)
    assert row["max_abs_delta_logit"] == 2.0
    assert divergence([1, 2, 3], [1, 2, 4]) == 2
    assert divergence([1, 2], [1, 2]) == 2
