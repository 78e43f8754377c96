"""Vectorized sampling for a whole batch: one pass of tensor ops over the rows that
sample this step, no per-request Python.

Order: the allowed-token mask of a constrained row (structured outputs: a disallowed
token's logit becomes -inf, so nothing after can bring it back), logit bias (OpenAI's,
added to the raw logits), repetition penalty (over prompt + generated ids, as in
transformers), frequency and presence penalties (over generated ids, as in vLLM /
OpenAI), then for sampling rows temperature, top-k, top-p, typical-p, min-p, and a draw.
Greedy rows take the argmax of the penalized logits.

Each row's draw is a pure function of (seed, position of the sampled token): one
uniform number from an integer hash of the two, turned into a token by inverse-CDF
over the row's processed distribution. It does not depend on which other requests share
the batch, and costs one cumsum instead of a noise tensor over the vocabulary.

`processed_logprobs` gives the whole distribution each row draws from (what speculative
verification compares a draft's distribution with); `sample` draws from the same.

Per-request parameters live in a float32 row of `NUM_PARAMS` columns, built once when a
request joins (`param_row`) and kept by the batch state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cadence.layers.kernel_ops import GreedyFn
from cadence.pb import shard_pb2

# columns of a parameter row
DO_SAMPLE, TEMPERATURE, TOP_K, TOP_P, TYPICAL_P, MIN_P = 0, 1, 2, 3, 4, 5
REPETITION, FREQUENCY, PRESENCE, TOP_N = 6, 7, 8, 9
NUM_PARAMS = 10

# features a batch may need; the state counts how many held requests use each
LOGIT_BIAS = "logit_bias"
PENALTY, TEMPERATURE_F, TOP_K_F, TOP_P_F, TYPICAL_F, MIN_P_F = (
    "penalty",
    "temperature",
    "top_k",
    "top_p",
    "typical_p",
    "min_p",
)


def param_row(p: shard_pb2.SamplingParams, top_n: int) -> tuple[list[float], set[str]]:
    """A request's parameter row and the features it uses. Proto3 zeros mean "off":
    top_p/typical_p outside (0, 1), repetition_penalty <= 0, and sampling with
    temperature <= 0 (which is greedy)."""
    do_sample = p.do_sample and p.temperature > 0
    top_p = p.top_p if 0 < p.top_p < 1 else 1.0
    typical_p = p.typical_p if 0 < p.typical_p < 1 else 1.0
    min_p = p.min_p if 0 < p.min_p < 1 else 0.0
    rep = p.repetition_penalty if p.repetition_penalty > 0 else 1.0
    row = [
        float(do_sample),
        p.temperature if do_sample else 1.0,
        float(p.top_k),
        top_p,
        typical_p,
        min_p,
        rep,
        p.frequency_penalty,
        p.presence_penalty,
        float(top_n),
    ]
    features: set[str] = set()
    if p.logit_bias:
        features.add(LOGIT_BIAS)
    if rep != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
        features.add(PENALTY)
    if do_sample:
        checks = (
            (TEMPERATURE_F, row[TEMPERATURE] != 1.0),
            (TOP_K_F, p.top_k > 0),
            (TOP_P_F, top_p < 1.0),
            (TYPICAL_F, typical_p < 1.0),
            (MIN_P_F, min_p > 0.0),
        )
        features.update(name for name, on in checks if on)
    return row, features


@dataclass(slots=True)
class SamplingBatch:
    params: torch.Tensor  # [R, NUM_PARAMS] float32
    seeds: torch.Tensor  # [R] int64 (the uint64 seed's bits)
    positions: torch.Tensor  # [R] int64: index of the token being sampled
    history: torch.Tensor | None  # [R, W] int64 token ids, for penalties
    seq_lens: torch.Tensor | None  # [R] valid length of each history row
    prompt_lens: torch.Tensor | None  # [R]
    features: frozenset[str]
    any_sample: bool
    max_top_n: int
    # sparse logit bias: (row, token id, value) triples, None when no row has one
    bias_rows: torch.Tensor | None = None
    bias_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    # allowed-token masks of the constrained rows, None when no row has one: the rows
    # [M] and their packed bits [M, ceil(vocab / 32)] int32 (read by `mask_disallowed`)
    allowed_rows: torch.Tensor | None = None
    allowed_words: torch.Tensor | None = None


@dataclass(slots=True)
class SampleOutput:
    ids: torch.Tensor  # [R] int64
    logprobs: torch.Tensor  # [R] float32
    top_ids: torch.Tensor | None  # [R, max_top_n]
    top_logprobs: torch.Tensor | None


_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) on int64 tensors holding values < 2**32."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, salt: int = 0) -> torch.Tensor:
    """One float64 uniform in [0, 1) per row, a pure function of (seed, position, salt).
    The sampler's draw uses salt 0; other uses of randomness at the same position (the
    speculative verifiers' coins) take their own salt, so their uniforms are independent
    of the draw's."""
    h = _mix32((seeds & _MASK32) ^ 0x9E3779B9)
    h = _mix32(h ^ ((seeds >> 32) & _MASK32))
    h = _mix32(h ^ (positions & _MASK32))
    if salt:
        h = _mix32(h ^ salt)
    lo = _mix32(h ^ 0x85EBCA6B)
    bits = ((h >> 11) << 32) | lo  # 53 random bits
    return bits.double() / float(1 << 53)


def _byte_bias(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256, 8]: for each byte value, 0 where its bit i is set (allowed) and -inf where
    not, least significant bit first."""
    key = (dtype, device)
    table = _BYTE_BIAS.get(key)
    if table is None:
        bits = (
            torch.arange(256, device=device)
            .unsqueeze(1)
            .bitwise_right_shift(torch.arange(8, device=device))
            .bitwise_and(1)
        )
        table = torch.zeros(256, 8, dtype=dtype, device=device).masked_fill_(
            bits == 0, float("-inf")
        )
        _BYTE_BIAS[key] = table
    return table


_BYTE_BIAS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def mask_disallowed(logits: torch.Tensor, rows: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """A copy of `logits` (any float dtype) whose rows `rows` have the tokens their masks
    `words` disallow at -inf. Each mask byte looks up its 8 tokens' bias (0 or -inf) in a
    256-row table, which costs a quarter of unpacking bits and filling by a bool mask."""
    m, width = words.shape[0], logits.shape[1]
    octets = words.contiguous().view(torch.uint8).long()  # little-endian: low byte first
    bias = torch.nn.functional.embedding(octets, _byte_bias(logits.dtype, logits.device))
    masked = logits[rows] + bias.view(m, -1)[:, :width]
    return logits.index_put((rows,), masked)


def apply_penalties(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    assert b.history is not None and b.seq_lens is not None and b.prompt_lens is not None
    rows, vocab = logits.shape
    cols = torch.arange(b.history.shape[1], device=logits.device)
    valid = cols < b.seq_lens.unsqueeze(1)
    generated = valid & (cols >= b.prompt_lens.unsqueeze(1))
    # an extra column absorbs the padding
    seen = torch.zeros(rows, vocab + 1, dtype=torch.bool, device=logits.device)
    seen.scatter_(1, b.history.masked_fill(~valid, vocab), True)
    counts = torch.zeros(rows, vocab + 1, dtype=logits.dtype, device=logits.device)
    ids = b.history.masked_fill(~generated, vocab)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=logits.dtype))
    seen, counts = seen[:, :vocab], counts[:, :vocab]
    rep = b.params[:, REPETITION].unsqueeze(1)
    penalized = torch.where(logits < 0, logits * rep, logits / rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - b.params[:, FREQUENCY].unsqueeze(1) * counts
    return logits - b.params[:, PRESENCE].unsqueeze(1) * (counts > 0).to(logits.dtype)


def _warp(x: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """Temperature, top-k, top-p, typical-p, min-p on the sampling distribution."""
    p, f = b.params, b.features
    neg_inf = float("-inf")
    if TEMPERATURE_F in f:
        x = x / p[:, TEMPERATURE].unsqueeze(1)
    if f & {TOP_K_F, TOP_P_F}:
        sorted_x, order = x.sort(dim=-1, descending=True)
        ranks = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        remove = torch.zeros_like(sorted_x, dtype=torch.bool)
        if TOP_K_F in f:
            k = p[:, TOP_K].long().unsqueeze(1)
            remove |= (k > 0) & (ranks >= k)
        if TOP_P_F in f:
            probs = sorted_x.masked_fill(remove, neg_inf).softmax(dim=-1)
            before = probs.cumsum(dim=-1) - probs  # mass of the better tokens
            top_p = p[:, TOP_P].unsqueeze(1)
            remove |= (top_p < 1) & (before > top_p)
        x = x.masked_fill(remove.scatter(1, order, remove), neg_inf)
    if TYPICAL_F in f:
        logp = x.log_softmax(dim=-1)
        entropy = -(logp.exp() * logp).nan_to_num(0.0).sum(dim=-1, keepdim=True)
        surprise, order = (-logp - entropy).abs().sort(dim=-1)
        cum = x.gather(1, order).softmax(dim=-1).cumsum(dim=-1)
        mass = p[:, TYPICAL_P].unsqueeze(1)
        last = (cum < mass).sum(dim=1, keepdim=True).clamp(max=x.shape[1] - 1)
        remove = (mass < 1) & (surprise > surprise.gather(1, last))
        x = x.masked_fill(remove.scatter(1, order, remove), neg_inf)
    if MIN_P_F in f:
        probs = x.softmax(dim=-1)
        floor = p[:, MIN_P].unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        x = x.masked_fill(probs < floor, neg_inf)
    return x


def _constrained(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """`logits` with each constrained row's disallowed tokens at -inf."""
    if b.allowed_rows is None:
        return logits
    assert b.allowed_words is not None
    return mask_disallowed(logits, b.allowed_rows, b.allowed_words)


def _biased_and_penalized(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """A float32 copy of `logits` with the logit bias added and the penalties applied."""
    logits = logits.float()
    if b.bias_rows is not None:
        logits = logits.index_put((b.bias_rows, b.bias_ids), b.bias_values, accumulate=True)
    if PENALTY in b.features:
        logits = apply_penalties(logits, b)
    return logits


def _log_distribution(penalized: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """Log-probs of what each row draws from: greedy rows the penalized log-softmax,
    sampling rows the warped one."""
    logprobs = penalized.log_softmax(dim=-1)
    if b.any_sample:
        warped = _warp(penalized, b).log_softmax(dim=-1)
        do_sample = b.params[:, DO_SAMPLE].bool().unsqueeze(1)
        logprobs = torch.where(do_sample, warped, logprobs)
    return logprobs


def processed_logprobs(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """[R, vocab] float32 log-probs of the distribution each row's token is drawn from
    (mask, bias, penalties, and for sampling rows the warpers); a greedy row's argmax is
    its greedy pick."""
    return _log_distribution(_biased_and_penalized(_constrained(logits, b), b), b)


def draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of `probs` [R, vocab] (float64 weights, not necessarily
    normalized) by inverse CDF: the first whose cumulative weight passes the row's uniform
    times the row's total."""
    cdf = probs.cumsum(dim=-1)
    target = uniforms.unsqueeze(1) * cdf[:, -1:]
    drawn = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return drawn.clamp(max=probs.shape[1] - 1)


def sample(
    logits: torch.Tensor, b: SamplingBatch, greedy_kernel: GreedyFn | None = None
) -> SampleOutput:
    """logits: [R, vocab] of the rows that sample this step. `greedy_kernel` (the shard's
    bound `LayerOps.greedy`) serves every greedy row without top-n alternatives, whatever
    the other rows do: a row's token and logprob then come from the one kernel (its own
    fixed-order log-sum-exp) in any batch. It reads masked rows' -inf entries as
    probability 0."""
    logits = _constrained(logits, b)
    greedy = not b.any_sample and b.max_top_n == 0
    unchanged = b.bias_rows is None and PENALTY not in b.features
    if greedy and unchanged and greedy_kernel is not None:
        # one pass over the logits as the model gave them (bfloat16 read as is), no
        # float32 copy and no log_softmax row
        ids, chosen = greedy_kernel(logits)
        return SampleOutput(ids, chosen, None, None)
    logits = _biased_and_penalized(logits, b)
    if greedy and greedy_kernel is not None:
        ids, chosen = greedy_kernel(logits)
        return SampleOutput(ids, chosen, None, None)
    logprobs = _log_distribution(logits, b)
    ids = logits.argmax(dim=-1)
    if b.any_sample:
        drawn = draw(logprobs.double().exp(), uniform_noise(b.seeds, b.positions))
        ids = torch.where(b.params[:, DO_SAMPLE].bool(), drawn, ids)
    chosen = logprobs.gather(1, ids.unsqueeze(1)).squeeze(1)
    if greedy_kernel is not None:
        plain = (b.params[:, DO_SAMPLE] == 0) & (b.params[:, TOP_N] == 0)
        if bool(plain.any()):
            rows = plain.nonzero().squeeze(1)
            ids[rows], chosen[rows] = greedy_kernel(logits.index_select(0, rows))
    top_ids = top_logprobs = None
    if b.max_top_n > 0:
        top_logprobs, top_ids = logprobs.topk(min(b.max_top_n, logprobs.shape[1]), dim=-1)
    return SampleOutput(ids, chosen, top_ids, top_logprobs)
