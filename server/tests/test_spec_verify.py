"""The verifiers on synthetic distributions: rejection sampling emits the target's
distribution (and an implementation that skips the test does not), the synthetic rule
accepts at its set rate, and the expanded sampling inputs see the tentative proposals."""

from __future__ import annotations

import math

import torch
from cadence.pb import shard_pb2
from cadence.sampling import SamplingBatch, draw, param_row, processed_logprobs, uniform_noise
from cadence.speculative.verify import (
    expand,
    leading_true,
    rejection_sample,
    synthetic_accepted,
)

V = 8
K = 2  # proposals per row
N = 200_000  # rows, each one independent run of the sampler
FAILURE = 1e-6  # the chance that a correct sampler fails the bound


def tv_bound(n: int, vocab: int = V, failure: float = FAILURE) -> float:
    """A total-variation distance the empirical distribution of n draws stays under with
    probability 1 - failure: TV is the largest |P_n(S) - P(S)| over the 2^vocab sets S,
    and Hoeffding bounds each by 2 exp(-2 n t^2); a union over the sets gives t."""
    return math.sqrt(((vocab + 1) * math.log(2) + math.log(1 / failure)) / (2 * n))


def _distributions() -> tuple[torch.Tensor, torch.Tensor]:
    """Target p and draft q for K + 1 positions: q far from p (TV > 0.3 at each)."""
    g = torch.Generator().manual_seed(0)
    p = (torch.randn(K + 1, V, generator=g) * 1.5).softmax(-1)
    q = (torch.randn(K, V, generator=g) * 1.5).softmax(-1)
    assert ((p[:K] - q).abs().sum(-1) / 2 > 0.3).all()
    return p, q


def _draft_draws(q: torch.Tensor) -> torch.Tensor:
    """[N * K] proposals: row r's j-th drawn from q[j]."""
    g = torch.Generator().manual_seed(1)
    return torch.stack([torch.multinomial(q[j], N, True, generator=g) for j in range(K)], 1)


def _emitted(sampler, p: torch.Tensor, q: torch.Tensor) -> list[torch.Tensor]:
    """The tokens emitted at each position over N runs of `sampler` (rejection_sample's
    signature): entry j holds the runs' token j, among the runs that reached it."""
    proposals = _draft_draws(q)
    k = torch.full((N,), K)
    target = p.log().repeat(N, 1)  # [N * (K + 1), V]
    draft = q.log().repeat(N, 1)  # [N * K, V]
    accepted, last = sampler(
        target, draft, proposals.reshape(-1), k, torch.arange(N), torch.full((N,), 40)
    )
    emitted = torch.cat([proposals, torch.zeros(N, 1, dtype=torch.long)], 1)
    emitted[torch.arange(N), accepted] = last
    return [emitted[accepted >= j, j] for j in range(K + 1)]


def _tv(tokens: torch.Tensor, p: torch.Tensor) -> float:
    freq = torch.bincount(tokens, minlength=V).double() / len(tokens)
    return float((freq - p.double()).abs().sum() / 2)


def test_rejection_sampling_emits_the_target_distribution_at_every_position():
    p, q = _distributions()
    for j, tokens in enumerate(_emitted(rejection_sample, p, q)):
        assert len(tokens) > N // 20, j  # every position is reached often
        assert _tv(tokens, p[j]) < tv_bound(len(tokens)), j


def test_a_sampler_that_accepts_every_proposal_fails_the_same_bound():
    p, q = _distributions()

    def accept_all(target, draft, proposals, k, seeds, positions):
        bonus = draw(target[K :: K + 1].double().exp(), uniform_noise(seeds, positions + K))
        return k.clone(), bonus

    tokens = _emitted(accept_all, p, q)
    assert _tv(tokens[0], p[0]) > 10 * tv_bound(len(tokens[0]))  # it emits q's draws


def test_a_draft_equal_to_the_target_is_always_accepted_and_a_disjoint_one_never():
    p, _ = _distributions()
    n = 1000
    k = torch.full((n,), K)
    target = p.log().repeat(n, 1)
    proposals = _draft_draws(p[:K])[:n].reshape(-1)
    accepted, _ = rejection_sample(
        target, p[:K].log().repeat(n, 1), proposals, k, torch.arange(n), torch.zeros_like(k)
    )
    assert (accepted == K).all()
    # a draft that only proposes token 0, where the target puts no mass
    target = p.clone()
    target[:, 0] = 0
    target = (target / target.sum(-1, keepdim=True)).log().repeat(n, 1)
    only_zero = torch.full((K, V), float("-inf"))
    only_zero[:, 0] = 0
    accepted, last = rejection_sample(
        target, only_zero.repeat(n, 1), torch.zeros(n * K, dtype=torch.long), k,
        torch.arange(n), torch.zeros(n, dtype=torch.long),
    )  # fmt: skip
    assert (accepted == 0).all() and (last != 0).all()


def test_one_seed_gives_one_answer():
    p, q = _distributions()
    n = 64
    args = (
        p.log().repeat(n, 1),
        q.log().repeat(n, 1),
        _draft_draws(q)[:n].reshape(-1),
        torch.full((n,), K),
        torch.full((n,), 7),
        torch.arange(n) * 3,
    )
    a1, t1 = rejection_sample(*args)
    a2, t2 = rejection_sample(*args)
    assert torch.equal(a1, a2) and torch.equal(t1, t2)
    a3, _ = rejection_sample(*args[:4], torch.full((n,), 8), args[5])
    assert not torch.equal(a1, a3)


def test_synthetic_acceptance_keeps_proposals_at_the_set_rate():
    rate, n, k = 0.7, 50_000, 4
    counts = torch.full((n,), k)
    rows = torch.repeat_interleave(torch.arange(n), counts)
    positions = rows * 10 + torch.arange(n * k) % k
    accepted = synthetic_accepted(rows, positions, counts, rate)
    # accepted = j with probability rate^j (1 - rate), k with rate^k
    expected = torch.tensor([rate**j * (1 - rate) for j in range(k)] + [rate**k])
    freq = torch.bincount(accepted, minlength=k + 1).double() / n
    assert float((freq - expected).abs().sum() / 2) < tv_bound(n, k + 1)


def test_leading_true_counts_each_rows_run():
    ok = torch.tensor([True, False, True, True, True, False, False, True])
    # rows of 3, 0, 2 and 3 entries
    assert leading_true(ok, torch.tensor([3, 0, 2, 3])).tolist() == [1, 0, 2, 0]


def test_expanded_rows_sample_each_position_with_the_history_up_to_it():
    params = [
        shard_pb2.SamplingParams(repetition_penalty=2.0, logit_bias={5: 3.0}),
        shard_pb2.SamplingParams(do_sample=True, temperature=0.7, seed=3),
    ]
    rows, features = zip(*(param_row(p, 0) for p in params), strict=True)
    history = torch.tensor([[1, 2, 3, 4, 5, 6], [7, 8, 9, 0, 0, 0]])
    b = SamplingBatch(
        params=torch.tensor(rows),
        seeds=torch.tensor([0, 3]),
        positions=torch.tensor([6, 3]),
        history=history,
        seq_lens=torch.tensor([6, 3]),
        prompt_lens=torch.tensor([2, 2]),
        features=frozenset().union(*features),
        any_sample=True,
        max_top_n=0,
        bias_rows=torch.tensor([0]),
        bias_ids=torch.tensor([5]),
        bias_values=torch.tensor([3.0]),
    )
    e = expand(b, torch.tensor([2, 0]))  # row 0 proposed tokens 5, 6; row 1 nothing
    assert e.positions.tolist() == [4, 5, 6, 3] and e.seq_lens.tolist() == [4, 5, 6, 3]
    assert e.seeds.tolist() == [0, 0, 0, 3] and e.bias_rows.tolist() == [0, 1, 2]
    logits = torch.zeros(4, 10)
    logits[:, 4] = logits[:, 5] = 1.0
    lp = processed_logprobs(logits, e)
    # token 4 is penalized from the first position on, token 5 once it is in the history
    assert lp[0, 5] > lp[0, 4] and lp[1, 5] < lp[0, 5] and lp[2, 5] == lp[1, 5]
