"""The draft model's sampling inputs for each of its proposals, and its draw.

The k proposals of a request are sampled one after another, each as the target's
sampler would sample that position: the request's own parameters and logit bias, the
position of the token being drafted, and a penalty history that ends with the
proposals drafted before it (the tokens it would follow if they are accepted)."""

from __future__ import annotations

import torch

from cadence.sampling import DO_SAMPLE, SamplingBatch, draw, uniform_noise

# The salt of a draft draw's uniform: not the sampler's draw (0) nor one of the
# verifiers' coins (cadence.speculative.verify: 1..3) at the same position.
DRAFT_SALT = 4


def step_sampling(b: SamplingBatch, rows: torch.Tensor, drafted: torch.Tensor) -> SamplingBatch:
    """The sampling inputs of `b`'s rows `rows` (on b's device) for the token after the
    proposals `drafted` [len(rows), j] each of them already has."""
    j = drafted.shape[1]
    history = seq_lens = None
    if b.history is not None:
        assert b.seq_lens is not None
        seq_lens = b.seq_lens[rows]
        history = torch.cat([b.history[rows], drafted.new_zeros(len(rows), j)], dim=1)
        offsets = torch.arange(j, device=drafted.device)
        history.scatter_(1, seq_lens.unsqueeze(1) + offsets, drafted)
        seq_lens = seq_lens + j
    bias_rows = bias_ids = bias_values = None
    if b.bias_rows is not None:
        assert b.bias_ids is not None and b.bias_values is not None
        new_row = torch.full((b.params.shape[0],), -1, dtype=torch.long, device=rows.device)
        new_row[rows] = torch.arange(len(rows), device=rows.device)
        kept = new_row[b.bias_rows] >= 0
        bias_rows = new_row[b.bias_rows[kept]]
        bias_ids, bias_values = b.bias_ids[kept], b.bias_values[kept]
    params = b.params[rows]
    return SamplingBatch(
        params=params,
        seeds=b.seeds[rows],
        positions=b.positions[rows] + j,
        history=history,
        seq_lens=seq_lens,
        prompt_lens=b.prompt_lens[rows] if b.prompt_lens is not None else None,
        features=b.features,
        any_sample=bool(params[:, DO_SAMPLE].any()),
        max_top_n=0,
        bias_rows=bias_rows,
        bias_ids=bias_ids,
        bias_values=bias_values,
    )


def draft_tokens(logprobs: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """One token per row of the processed log-probs [R, V]: the argmax for greedy rows,
    an inverse-CDF draw at the salted uniform of (seed, position) for sampling rows."""
    ids = logprobs.argmax(dim=-1)
    if not b.any_sample:
        return ids
    drawn = draw(logprobs.double().exp(), uniform_noise(b.seeds, b.positions, DRAFT_SALT))
    return torch.where(b.params[:, DO_SAMPLE].bool(), drawn, ids)
