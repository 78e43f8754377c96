"""Vectorized sampling: each processor matches its definition (or transformers' warper),
draws follow the distribution and depend only on (seed, position)."""

from __future__ import annotations

import pytest
import torch
from cadence.pb import shard_pb2
from cadence.sampling import SamplingBatch, _warp, param_row, sample, uniform_noise
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

V = 64


def _batch(params: list[shard_pb2.SamplingParams], top_n: int = 0, **extra) -> SamplingBatch:
    rows, features = [], set()
    for p in params:
        row, f = param_row(p, top_n)
        rows.append(row)
        features |= f
    t = torch.tensor(rows, dtype=torch.float32)
    n = len(params)
    b = SamplingBatch(
        params=t,
        seeds=torch.tensor([p.seed for p in params], dtype=torch.long),
        positions=extra.pop("positions", torch.arange(n) + 10),
        history=None,
        seq_lens=None,
        prompt_lens=None,
        features=frozenset(features),
        any_sample=bool(t[:, 0].any()),
        max_top_n=top_n,
    )
    for k, v in extra.items():
        setattr(b, k, v)
    return b


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_rows_take_the_argmax_with_its_log_softmax():
    logits = _logits(4)
    out = sample(logits, _batch([shard_pb2.SamplingParams()] * 4, top_n=3))
    assert torch.equal(out.ids, logits.argmax(-1))
    ref = logits.log_softmax(-1)
    torch.testing.assert_close(out.logprobs, ref.max(-1).values)
    torch.testing.assert_close(out.top_logprobs, ref.topk(3).values)
    assert torch.equal(out.top_ids, ref.topk(3).indices)


def test_penalties_match_their_definitions():
    logits = _logits(2, seed=1)
    history = torch.tensor([[5, 9, 9, 3, 7, 7, 7, 0], [1, 2, 3, 4, 4, 0, 0, 0]])
    seq_lens, prompt_lens = torch.tensor([7, 5]), torch.tensor([2, 3])
    params = [
        shard_pb2.SamplingParams(
            repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.25
        ),
        shard_pb2.SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.3),
    ]
    b = _batch(params, top_n=V, history=history, seq_lens=seq_lens, prompt_lens=prompt_lens)
    out = sample(logits, b)
    expected = logits.clone()
    for r, (p, n, pl) in enumerate(zip(params, seq_lens, prompt_lens, strict=True)):
        ids = history[r, :n]
        # repetition penalty over prompt + generated ids, as transformers defines it
        rep = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)
        expected[r] = rep(ids.unsqueeze(0), expected[r : r + 1].clone())[0]
        for tok in set(ids[pl:].tolist()):  # frequency/presence over generated ids (OpenAI)
            count = int((ids[pl:] == tok).sum())
            expected[r, tok] -= p.frequency_penalty * count + p.presence_penalty
    assert torch.equal(out.ids, expected.argmax(-1))
    torch.testing.assert_close(out.top_logprobs, expected.log_softmax(-1).sort(-1, True).values)


@pytest.mark.parametrize(
    ("params", "warper"),
    [
        (dict(top_k=5), TopKLogitsWarper(5)),
        (dict(top_p=0.7), TopPLogitsWarper(0.7)),
        (dict(typical_p=0.6), TypicalLogitsWarper(0.6)),
        (dict(min_p=0.1), MinPLogitsWarper(0.1)),
    ],
)
def test_filters_keep_the_same_tokens_as_transformers(params, warper):
    logits = _logits(6, seed=2)
    b = _batch([shard_pb2.SamplingParams(do_sample=True, temperature=1.0, **params)] * 6)
    ours = torch.isfinite(_warp(logits, b))
    theirs = torch.isfinite(warper(None, logits.clone()))
    assert torch.equal(ours, theirs)


def test_filters_leave_rows_that_do_not_use_them_alone():
    logits = _logits(2, seed=3)
    b = _batch(
        [
            shard_pb2.SamplingParams(do_sample=True, temperature=1.0, top_k=3, top_p=0.5),
            shard_pb2.SamplingParams(do_sample=True, temperature=1.0),
        ]
    )
    warped = _warp(logits, b)
    assert torch.isfinite(warped[1]).all() and torch.isfinite(warped[0]).sum() <= 3


def test_tiny_top_p_and_top_k_one_pick_the_argmax():
    logits = _logits(8, seed=4)
    seeds = [shard_pb2.SamplingParams(do_sample=True, temperature=1.0, seed=s) for s in range(8)]
    for p in seeds[:4]:
        p.top_p = 1e-6
    for p in seeds[4:]:
        p.top_k = 1
    out = sample(logits, _batch(seeds))
    assert torch.equal(out.ids, logits.argmax(-1))
    assert torch.allclose(out.logprobs, torch.zeros(8))  # the only token left


def test_sampled_logprobs_are_the_log_softmax_of_the_processed_distribution():
    logits = _logits(3, seed=5)
    p = shard_pb2.SamplingParams(do_sample=True, temperature=0.7, top_k=10, seed=1)
    b = _batch([p] * 3, top_n=4)
    out = sample(logits, b)
    processed = (
        (logits / 0.7)
        .masked_fill(logits < logits.topk(10).values[:, -1:], float("-inf"))
        .log_softmax(-1)
    )
    torch.testing.assert_close(out.logprobs, processed.gather(1, out.ids[:, None])[:, 0])
    torch.testing.assert_close(out.top_logprobs, processed.topk(4).values)


def test_draws_follow_the_distribution():
    n = 20000
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0] + [-30.0] * (V - 5)]).repeat(n, 1)
    p = shard_pb2.SamplingParams(do_sample=True, temperature=1.0, seed=7)
    out = sample(logits, _batch([p] * n, positions=torch.arange(n)))
    freq = torch.bincount(out.ids, minlength=V)[:4].float() / n
    torch.testing.assert_close(freq, logits[0, :4].softmax(-1), atol=0.015, rtol=0)


def test_noise_is_a_pure_function_of_seed_and_position():
    seeds = torch.tensor([1, 1, 2, -5, 1])
    positions = torch.tensor([10, 11, 10, 10, 10])
    u = uniform_noise(seeds, positions)
    assert u[0] == u[4] and len(set(u.tolist())) == 4
    assert ((u >= 0) & (u < 1)).all()
    assert uniform_noise(seeds[2:3], positions[2:3]) == u[2]
