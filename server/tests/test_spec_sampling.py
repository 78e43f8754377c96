"""The sampler's processed distribution (`processed_logprobs`) is the one `sample` draws
from, and salted uniforms are independent of the draw's."""

from __future__ import annotations

import torch
from cadence.pb import shard_pb2
from cadence.sampling import (
    SamplingBatch,
    param_row,
    processed_logprobs,
    sample,
    uniform_noise,
)

V = 64


def _batch(params: list[shard_pb2.SamplingParams], history: torch.Tensor) -> SamplingBatch:
    rows, features = [], set()
    for p in params:
        row, f = param_row(p, 5)
        rows.append(row)
        features |= f
    t = torch.tensor(rows, dtype=torch.float32)
    n = len(params)
    return SamplingBatch(
        params=t,
        seeds=torch.tensor([p.seed for p in params], dtype=torch.long),
        positions=torch.full((n,), history.shape[1]),
        history=history,
        seq_lens=torch.full((n,), history.shape[1]),
        prompt_lens=torch.full((n,), 2),
        features=frozenset(features),
        any_sample=bool(t[:, 0].any()),
        max_top_n=5,
        bias_rows=torch.tensor([0, 2]),
        bias_ids=torch.tensor([7, 9]),
        bias_values=torch.tensor([4.0, -3.0]),
    )


def test_processed_logprobs_are_what_sample_draws_from_and_reports():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, V, generator=g) * 3
    history = torch.randint(0, V, (4, 6), generator=g)
    params = [
        shard_pb2.SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5),
        shard_pb2.SamplingParams(do_sample=True, temperature=0.8, top_k=12, seed=4),
        shard_pb2.SamplingParams(
            do_sample=True, temperature=1.0, top_p=0.8, presence_penalty=1, seed=5
        ),
        shard_pb2.SamplingParams(do_sample=True, temperature=1.4, min_p=0.05, seed=6),
    ]
    b = _batch(params, history)
    out = sample(logits, b)
    logprobs = processed_logprobs(logits, b)
    assert logprobs.dtype == torch.float32 and logprobs.shape == (4, V)
    assert int(logprobs[0].argmax()) == int(out.ids[0])  # the greedy row's pick
    torch.testing.assert_close(logprobs.gather(1, out.ids[:, None])[:, 0], out.logprobs)
    torch.testing.assert_close(logprobs.topk(5).values, out.top_logprobs)
    # the warpers cut tokens out of the sampling rows' distributions, not the greedy one's
    assert torch.isinf(logprobs[1:]).any(dim=1).all() and torch.isfinite(logprobs[0]).all()
    torch.testing.assert_close(logprobs.exp().sum(-1), torch.ones(4))


def test_salted_uniforms_are_pure_distinct_and_uniform():
    n = 50_000
    seeds = torch.full((n,), 11)
    positions = torch.arange(n)
    plain = uniform_noise(seeds, positions)
    assert torch.equal(plain, uniform_noise(seeds, positions, salt=0))
    salted = [uniform_noise(seeds, positions, salt=s) for s in (1, 2)]
    assert torch.equal(salted[0], uniform_noise(seeds, positions, salt=1))
    for u in salted:
        assert ((u >= 0) & (u < 1)).all()
        assert abs(float(u.mean()) - 0.5) < 0.01  # sd of the mean: 0.0013
        # uncorrelated with the draw's uniforms at the same positions
        assert abs(float(torch.corrcoef(torch.stack([u, plain]))[0, 1])) < 0.02
    assert abs(float(torch.corrcoef(torch.stack(salted))[0, 1])) < 0.02
