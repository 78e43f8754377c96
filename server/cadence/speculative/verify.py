"""Verification of speculative proposals on the shard.

A speculating request's row computed its last sampled token t (position p) and k
proposals d_1..d_k in one forward; the logits at its 1 + k positions predict the tokens
at p+1..p+1+k. Verification decides how many proposals to keep (a) and the token after
them, by one of three rules, each row its own:

- sample and match (the router's n-gram proposals, a draft's in greedy rows): sample the
  token at every position exactly as the non-speculative sampler would -- same processors,
  penalties over the tokens up to there (the tentatively accepted proposals included), the
  same draw `uniform_noise(seed, position)` -- and keep proposals while they equal the
  samples. The answer is the samples s_0..s_a: token for token what decoding one at a time
  gives.
- rejection sampling (a draft's proposals in sampling rows, with the draft's distribution
  q): keep d_j with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection draw
  from normalize(max(0, p_j - q_j)), after the last proposal draw the bonus from p_k. The
  output follows the target's distribution.
- synthetic (benchmarks only): keep d_j while a uniform is below the set acceptance rate,
  then emit the model's own token. The output is not the model's.

Every uniform is a pure function of (seed, position, salt), so one seed gives one answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cadence.layers.kernel_ops import GreedyFn
from cadence.sampling import SamplingBatch, draw, processed_logprobs, sample, uniform_noise
from cadence.shard.state import offsets_within

# salts of the verifiers' uniforms (salt 0 is the sampler's own draw)
ACCEPT_SALT, RESIDUAL_SALT, SYNTHETIC_SALT = 1, 2, 3


def group_starts(counts: torch.Tensor) -> torch.Tensor:
    """Index of each group's first element when groups of `counts` lie end to end."""
    return torch.cumsum(counts, 0) - counts


def select_rows(
    b: SamplingBatch, rows: torch.Tensor, back: torch.Tensor | None = None
) -> SamplingBatch:
    """A batch whose row i is `b`'s row `rows[i]` sampling the token `back[i]` positions
    earlier (0 when None): its position and penalty history shortened by as much."""
    on_cpu, rows = rows, rows.to(b.params.device)
    positions, seq_lens = b.positions[rows], None if b.seq_lens is None else b.seq_lens[rows]
    if back is not None:
        back = back.to(positions.device)
        positions = positions - back
        seq_lens = None if seq_lens is None else seq_lens - back
    out = SamplingBatch(
        params=b.params[rows],
        seeds=b.seeds[rows],
        positions=positions,
        history=None if b.history is None else b.history[rows],
        seq_lens=seq_lens,
        prompt_lens=None if b.prompt_lens is None else b.prompt_lens[rows],
        features=b.features,
        any_sample=b.any_sample,
        max_top_n=b.max_top_n,
    )
    if b.bias_rows is not None:
        assert b.bias_ids is not None and b.bias_values is not None
        new_row, i = _matches(on_cpu, b.bias_rows)
        if new_row.numel():
            out.bias_rows, out.bias_ids, out.bias_values = new_row, b.bias_ids[i], b.bias_values[i]
    if b.allowed_rows is not None:
        assert b.allowed_words is not None
        new_row, i = _matches(on_cpu, b.allowed_rows)
        if new_row.numel():
            out.allowed_rows, out.allowed_words = new_row, b.allowed_words[i]
    return out


def _matches(rows: torch.Tensor, entry_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every (i, e) with rows[i] == entry_rows[e]: a per-row entry list (logit bias, masks)
    carried over to the selected rows."""
    rows = rows.to(entry_rows.device)
    new_row, i = (rows.unsqueeze(1) == entry_rows.unsqueeze(0)).nonzero(as_tuple=True)
    return new_row, i


def expand(b: SamplingBatch, num_proposed: torch.Tensor) -> SamplingBatch:
    """One row per verified position: row r's k = num_proposed[r] proposals give it 1 + k
    rows, for the tokens at p+1..p+1+k (`b` samples the one at p+1+k: its known tokens
    end with the proposals)."""
    counts = num_proposed + 1
    rows = torch.repeat_interleave(torch.arange(len(counts)), counts)
    return select_rows(b, rows, num_proposed[rows] - offsets_within(counts))


def leading_true(ok: torch.Tensor, num_proposed: torch.Tensor) -> torch.Tensor:
    """[R]: how many of each row's entries of `ok` (groups of num_proposed, end to end)
    are True before its first False."""
    rows = torch.repeat_interleave(torch.arange(len(num_proposed)), num_proposed)
    j = offsets_within(num_proposed)
    rejected = ~ok.cpu()
    first = num_proposed.clone()
    return first.scatter_reduce_(0, rows[rejected], j[rejected], reduce="amin")


def proposal_positions(num_proposed: torch.Tensor) -> torch.Tensor:
    """Index, among the rows' verified positions (1 + k per row), of the position that
    decides each proposal: d_j's at the row's j-1-th."""
    starts = group_starts(num_proposed + 1)
    return torch.repeat_interleave(starts, num_proposed) + offsets_within(num_proposed)


def synthetic_accepted(
    seeds: torch.Tensor, positions: torch.Tensor, num_proposed: torch.Tensor, rate: float
) -> torch.Tensor:
    """[R] proposals kept by the synthetic rule: d_j while uniform(seed, position of d_j,
    SYNTHETIC_SALT) < rate. `seeds`, `positions`: per proposal."""
    return leading_true(uniform_noise(seeds, positions, SYNTHETIC_SALT) < rate, num_proposed)


def rejection_sample(
    target: torch.Tensor,
    draft: torch.Tensor,
    proposals: torch.Tensor,
    num_proposed: torch.Tensor,
    seeds: torch.Tensor,
    first_positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling of draft proposals. target: [sum(k + 1), V] log-probs of the
    target's processed distribution at each row's 1 + k positions; draft: [sum k, V]
    log-probs of the distributions the proposals [sum k] were drawn from; seeds and
    first_positions (index of d_1): per row. Returns per row the accepted count and the
    token after the accepted proposals."""
    device = target.device
    k = num_proposed
    rows = torch.repeat_interleave(torch.arange(len(k)), k)
    at = proposal_positions(k).to(device)
    d = proposals.to(device).unsqueeze(1)
    ratio_log = target[at].gather(1, d).squeeze(1) - draft.gather(1, d).squeeze(1)
    j = offsets_within(k)
    u = uniform_noise(seeds[rows], first_positions[rows] + j, ACCEPT_SALT).to(device)
    accepted = leading_true(u < ratio_log.double().exp(), k)
    # the token after them: from the residual at a rejection, else the bonus from p_k
    rejected = accepted < k
    p_next = target[(group_starts(k + 1) + accepted).to(device)].double().exp()
    q_next = torch.zeros_like(p_next)
    q_rows = (group_starts(k) + accepted)[rejected].to(device)
    q_next[rejected.to(device)] = draft[q_rows].double().exp()
    residual = (p_next - q_next).clamp(min=0)
    # a rejection needs p < q somewhere, so p > q elsewhere; rounding may still empty it
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_next)
    salts = [uniform_noise(seeds, first_positions + accepted, s) for s in (0, RESIDUAL_SALT)]
    u_next = torch.where(rejected, salts[1], salts[0]).to(device)
    return accepted, draw(residual, u_next).cpu()


@dataclass(slots=True)
class Verified:
    """The answers of a step's sampling rows: row r's 1 + accepted[r] tokens (its kept
    proposals, then the model's token), with their logprobs and top alternatives."""

    accepted: torch.Tensor  # [R] (0 for rows without proposals)
    tokens: torch.Tensor  # [sum(1 + accepted)]
    logprobs: torch.Tensor  # [sum(1 + accepted)]
    top_ids: torch.Tensor | None  # [sum(1 + accepted), max_top_n]
    top_logprobs: torch.Tensor | None


def verify(
    logits: torch.Tensor,
    b: SamplingBatch,
    num_proposed: torch.Tensor,
    proposals: torch.Tensor,
    synthetic: torch.Tensor,
    synthetic_rate: float,
    rejection: torch.Tensor,
    draft_logprobs: torch.Tensor | None = None,
    greedy_kernel: GreedyFn | None = None,
    synthetic_keys: torch.Tensor | None = None,
) -> Verified:
    """Verifies a step's sampling rows. logits: [sum(1 + k), V] at every verified position
    and `b` its expanded batch (`expand`), rows in order; num_proposed: [R] k per row;
    proposals: [sum k]. Rows are sampled and matched but the `synthetic` [R] bool rows
    (rule synthetic at `synthetic_rate`) and the `rejection` [R] bool rows (rejection
    sampling against `draft_logprobs`, [sum k of those rows, V]). `synthetic_keys` [R]
    (the requests' ids) are mixed into the synthetic draws' seeds, so that requests sharing
    a seed (every greedy one) do not accept alike."""
    k = num_proposed
    counts = k + 1
    starts = group_starts(counts)
    # the model's own token at every position, as the sampler picks it one at a time
    out = sample(logits, b, greedy_kernel)
    sampled = out.ids.cpu()
    at = proposal_positions(k)
    accepted = leading_true(sampled[at] == proposals, k)
    seeds, positions = b.seeds.cpu(), b.positions.cpu()
    if bool(synthetic.any()):
        keyed = (
            seeds
            if synthetic_keys is None
            else seeds ^ torch.repeat_interleave(synthetic_keys, counts)
        )
        by_rate = synthetic_accepted(keyed[at], positions[at], k, synthetic_rate)
        accepted = torch.where(synthetic, by_rate, accepted)
    last = sampled[starts + accepted]
    logprobs = out.logprobs
    by_distribution = synthetic | rejection
    if bool(by_distribution.any()):
        # kept proposals and rejection draws are not the sampler's picks: their logprobs
        # come from the processed distributions, which rejection sampling also reads
        rows = torch.repeat_interleave(by_distribution, counts).nonzero().squeeze(1)
        processed = processed_logprobs(logits[rows.to(logits.device)], select_rows(b, rows))
        if bool(rejection.any()):
            assert draft_logprobs is not None
            mine = torch.repeat_interleave(rejection[by_distribution], counts[by_distribution])
            accepted_r, last_r = rejection_sample(
                processed[mine.to(processed.device)],
                draft_logprobs,
                proposals[torch.repeat_interleave(rejection, k)],
                k[rejection],
                seeds[starts[rejection]],
                positions[starts[rejection]],
            )
            accepted, last = accepted.clone(), last.clone()
            accepted[rejection], last[rejection] = accepted_r, last_r
    # each position's token: the proposal, then (at j = a) the row's last token
    chosen = sampled.clone()
    chosen[at] = proposals
    chosen[starts + accepted] = last
    if bool(by_distribution.any()):
        picked = processed.gather(1, chosen[rows].to(processed.device).unsqueeze(1)).squeeze(1)
        logprobs = logprobs.clone()
        logprobs[rows.to(logprobs.device)] = picked
    keep = offsets_within(counts) <= torch.repeat_interleave(accepted, counts)
    top_ids = top_logprobs = None
    if out.top_ids is not None:
        assert out.top_logprobs is not None
        top_ids, top_logprobs = out.top_ids.cpu()[keep], out.top_logprobs.cpu()[keep]
    return Verified(accepted, chosen[keep], logprobs.cpu()[keep], top_ids, top_logprobs)
