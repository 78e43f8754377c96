"""Persistent per-request state, kept in slot-indexed CPU tensors, and the StepRequest
diff applied to it.

A request occupies one slot: its token ids (prompt, then generated), prompt length,
number of tokens whose KV is computed, block table and sampling parameters. A step is
`{request: tokens to compute}`; a request samples iff after the step every token it
knows is computed, and the sampled token is appended to its ids, to be computed by the
next step (`num_compute = 1`). Chunked prefill, prefix hits, recompute after
preemption and decode are all the same mechanism.

Structured outputs add two things to a step. A continuing request's `forced_tokens`
(tokens a grammar forced, appended by the router without sampling) are appended to its
ids before the forward, as generated tokens: past its prompt length, so the penalties
count them as output, and computed like any known token (by this step's `num_compute` or
a later one's). An `allowed` mask per constrained request that samples this step is
checked with the diff (`StepPlan.allowed_*`) and applied by the sampler before anything
else.

Speculative decoding adds proposals: tokens that may follow a decoding request's last
sampled token t (at position p), from the router (`proposed_tokens`) or the shard's draft
model (`num_draft_tokens`). They are appended after t like forced tokens and computed in
the same forward (num_compute = 1 + k); `prepare` then lists the 1 + k positions whose
logits verification needs, and `commit_verified` keeps t, the a accepted proposals and
the model's next token (computed = p + 1 + a), cutting the block table to the blocks the
computed tokens fill.

`StepPlan` is the diff as `cadence.shard.step_checks` passed it; `BatchState.apply` takes
it in, `BatchState.prepare` turns its rows into flat forward inputs with vectorized numpy
ops on views of the CPU tensors (a handful of Python operations per request, none per
token; numpy rather than torch calls, each a fraction of the dispatcher's cost, since the
step's serial Python is time the kernels' other threads spend waiting).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch
from loguru import logger

from cadence.pb import shard_pb2
from cadence.sampling import (
    DO_SAMPLE,
    LOGIT_BIAS,
    NUM_PARAMS,
    PENALTY,
    TOP_N,
    SamplingBatch,
    param_row,
)
from cadence.shard.flat_rows import decode_first, flat_rows
from cadence.shard.forward_batch import ForwardBatch
from cadence.shard.step_checks import StepPlan


@dataclass(slots=True)
class PromptLogprobs:
    """A request's prompt logprobs, gathered chunk by chunk until its first sample."""

    logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    sent: bool = False


def offsets_within(counts: torch.Tensor) -> torch.Tensor:
    """[sum(counts)]: 0..n-1 for each group of n in `counts`, groups in order."""
    total = int(counts.sum())
    group_starts = torch.cumsum(counts, 0) - counts
    return torch.arange(total) - torch.repeat_interleave(group_starts, counts, output_size=total)


def _grown(t: torch.Tensor, rows: int, cols: int = 0) -> torch.Tensor:
    """`t` copied into a larger zero tensor (each dimension at least doubling) when it
    has fewer than `rows` rows or, for 2-d tensors, fewer than `cols` columns."""
    shape = list(t.shape)
    new = list(shape)
    if rows > shape[0]:
        new[0] = max(rows, 2 * shape[0])
    if t.dim() > 1 and cols > shape[1]:
        new[1] = max(cols, 2 * shape[1])
    if new == shape:
        return t
    out = torch.zeros(new, dtype=t.dtype)
    out[tuple(slice(0, n) for n in shape)] = t
    return out


class BatchState:
    def __init__(
        self, block_size: int, num_blocks: int, vocab_size: int, capacity: int = 64
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.vocab_size = vocab_size
        self.slot_of: dict[int, int] = {}
        self.request_ids: dict[int, str] = {}  # router id -> the id its log lines carry
        self.free: list[int] = []
        self.features = Counter[str]()
        self.slot_features: dict[int, set[str]] = {}
        self.tokens = torch.zeros(capacity, 256, dtype=torch.long)
        self.seq_lens = torch.zeros(capacity, dtype=torch.long)
        self.prompt_lens = torch.zeros(capacity, dtype=torch.long)
        self.computed = torch.zeros(capacity, dtype=torch.long)
        self.block_tables = torch.zeros(capacity, 16, dtype=torch.long)
        self.num_block_ids = torch.zeros(capacity, dtype=torch.long)
        self.params = torch.zeros(capacity, NUM_PARAMS, dtype=torch.float32)
        self.seeds = torch.zeros(capacity, dtype=torch.long)
        # sparse per-request extras, only for the requests that ask for them
        self.logit_bias: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # slot -> ids, values
        self.prompt_logprobs: dict[int, PromptLogprobs] = {}  # slot -> accumulated so far
        self.proposed: dict[int, int] = {}  # slot -> proposals appended for the step in flight
        self.adapter_of: dict[int, str] = {}  # slot -> its LoRA adapter, for those with one
        self.free = list(range(capacity - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.slot_of)

    def request_id(self, id: int) -> str:
        """The id the log lines about held request `id` carry ("" when it has none)."""
        return self.request_ids.get(id, "")

    def clear(self) -> None:
        self.slot_of.clear()
        self.request_ids.clear()
        self.logit_bias.clear()
        self.prompt_logprobs.clear()
        self.proposed.clear()
        self.adapter_of.clear()
        self.slot_features.clear()
        self.features.clear()
        self.free = list(range(self.tokens.shape[0] - 1, -1, -1))

    # -- applying the diff ----------------------------------------------------------

    def remove(self, ids: list[int]) -> None:
        for i in ids:
            slot = self.slot_of.pop(i, None)
            if slot is not None:
                logger.debug("removed", id=i, request_id=self.request_ids.pop(i, ""))
                self.free.append(slot)
                self.logit_bias.pop(slot, None)
                self.prompt_logprobs.pop(slot, None)
                self.adapter_of.pop(slot, None)
                self.features.subtract(self.slot_features.pop(slot))

    def apply(self, plan: StepPlan, continuing: list[shard_pb2.ContinuingRequest]) -> None:
        """The checked diff's requests after `removed` (dropped first, `remove`): adds the
        joined ones, extends the continuing ones' block tables and appends their forced
        tokens and the router's proposals."""
        self.join(plan.joined)
        self.extend_blocks(continuing)
        self.append_forced(continuing)
        self.append_proposed(plan.proposals)

    def join(self, joined: list[shard_pb2.NewRequest]) -> None:
        if not joined:
            return
        self._reserve(len(self.slot_of) + len(joined))
        width = max(len(r.token_ids) for r in joined) + 1
        blocks = max(len(r.block_table) for r in joined)
        self.tokens = _grown(self.tokens, self.tokens.shape[0], width)
        self.block_tables = _grown(self.block_tables, self.block_tables.shape[0], blocks)
        slots: list[int] = []
        rows: list[list[float]] = []
        for r in joined:
            slot = self.free.pop()
            self.slot_of[r.id] = slot
            self.request_ids[r.id] = r.request_id
            logger.debug(
                "joined",
                id=r.id,
                request_id=r.request_id,
                tokens=len(r.token_ids),
                num_cached=r.num_cached,
                num_compute=r.num_compute,
            )
            slots.append(slot)
            row, features = param_row(r.sampling, r.top_n_tokens)
            rows.append(row)
            self.slot_features[slot] = features
            self.features.update(features)
            self.tokens[slot, : len(r.token_ids)] = torch.tensor(r.token_ids)
            self.block_tables[slot, : len(r.block_table)] = torch.tensor(r.block_table)
            if r.sampling.logit_bias:
                bias = sorted(r.sampling.logit_bias.items())
                self.logit_bias[slot] = (
                    torch.tensor([t for t, _ in bias], dtype=torch.long),
                    torch.tensor([v for _, v in bias], dtype=torch.float32),
                )
            if r.prompt_logprobs:
                self.prompt_logprobs[slot] = PromptLogprobs()
            if r.adapter_id:
                self.adapter_of[slot] = r.adapter_id
        s = torch.tensor(slots)
        self.seq_lens[s] = torch.tensor([len(r.token_ids) for r in joined])
        self.prompt_lens[s] = torch.tensor([r.prompt_len for r in joined])
        self.computed[s] = torch.tensor([r.num_cached for r in joined])
        self.num_block_ids[s] = torch.tensor([len(r.block_table) for r in joined])
        self.params[s] = torch.tensor(rows, dtype=torch.float32)
        seeds = [
            r.sampling.seed - (1 << 64) if r.sampling.seed >= 1 << 63 else r.sampling.seed
            for r in joined
        ]
        self.seeds[s] = torch.tensor(seeds, dtype=torch.long)

    def extend_blocks(self, continuing: list[shard_pb2.ContinuingRequest]) -> None:
        """Appends each continuing request's new blocks to its block table (through numpy
        views: no torch call per request)."""
        grown = [(self.slot_of[c.id], c.new_blocks) for c in continuing if c.new_blocks]
        if not grown:
            return
        counts = self.num_block_ids.numpy()
        width = max(int(counts[slot]) + len(new) for slot, new in grown)
        self.block_tables = _grown(self.block_tables, self.block_tables.shape[0], width)
        tables = self.block_tables.numpy()
        for slot, new in grown:
            n = int(counts[slot])
            tables[slot, n : n + len(new)] = new
            counts[slot] = n + len(new)

    def append_forced(self, continuing: list[shard_pb2.ContinuingRequest]) -> None:
        """Appends each continuing request's forced tokens to its known tokens (after its
        prompt: generated tokens), to be computed by this step or a later one."""
        forced = {c.id: list(c.forced_tokens) for c in continuing if c.forced_tokens}
        if forced:
            self._append(forced)

    def append_proposed(self, proposals: dict[int, list[int]]) -> None:
        """Appends proposals (request id -> tokens) after each request's last sampled
        token, to be computed and verified by this step, and remembers how many."""
        if proposals:
            slots = self._append(proposals)
            self.proposed.update(zip(slots, (len(t) for t in proposals.values()), strict=True))

    def _append(self, tokens: dict[int, list[int]]) -> list[int]:
        """Appends tokens (request id -> tokens) to the requests' known tokens; returns
        their slots."""
        slots = [self.slot_of[i] for i in tokens]
        lens = self.seq_lens[slots].tolist()
        ends = [n + len(t) for n, t in zip(lens, tokens.values(), strict=True)]
        self.tokens = _grown(self.tokens, self.tokens.shape[0], max(ends) + 1)
        for slot, t, start, end in zip(slots, tokens.values(), lens, ends, strict=True):
            self.tokens[slot, start:end] = torch.tensor(t)
        self.seq_lens[slots] = torch.tensor(ends)
        return slots

    def _reserve(self, n: int) -> None:
        have = self.tokens.shape[0]
        if n <= have:
            return
        for name in (
            "tokens",
            "seq_lens",
            "prompt_lens",
            "computed",
            "block_tables",
            "num_block_ids",
            "params",
            "seeds",
        ):
            setattr(self, name, _grown(getattr(self, name), n))
        self.free.extend(range(self.tokens.shape[0] - 1, have - 1, -1))

    # -- forward inputs -------------------------------------------------------------

    def prepare(self, rows: list[tuple[int, int]]) -> ForwardBatch:
        """Flat inputs for the scheduled (request id, num_compute) rows, decode first (the
        index arithmetic on numpy views of the state's CPU tensors, as `flat_rows`)."""
        rows = [rows[i] for i in decode_first([n for _, n in rows])]
        ids = [i for i, _ in rows]
        counts = [n for _, n in rows]
        at = np.array([self.slot_of[i] for i in ids], dtype=np.int64)
        slots = torch.from_numpy(at)
        flat = flat_rows(
            self.block_tables.numpy()[at], self.computed.numpy()[at], counts, self.block_size
        )
        layout = flat.layout
        positions = flat.positions
        query_start = layout.query_start.numpy()
        token_slot = at[flat.row]
        input_ids = self.tokens.numpy()[token_slot, positions]
        sampling = layout.context_lens.numpy() == self.seq_lens.numpy()[at]
        sample_rows = np.flatnonzero(sampling)
        sample_tokens = query_start[1:][sample_rows] - 1
        num_proposed = verify_tokens = None
        if self.proposed:
            sample_slots = at[sample_rows].tolist()
            num_proposed = torch.tensor([self.proposed.get(s, 0) for s in sample_slots])
            verified = num_proposed + 1  # positions whose logits each row needs
            starts = torch.repeat_interleave(
                torch.from_numpy(sample_tokens) - num_proposed, verified
            )
            verify_tokens = starts + offsets_within(verified)
        return ForwardBatch(
            ids=ids,
            slots=slots,
            input_ids=torch.from_numpy(input_ids),
            positions=torch.from_numpy(positions),
            layout=layout,
            sample_rows=torch.from_numpy(sample_rows),
            sample_tokens=torch.from_numpy(sample_tokens),
            num_prompt_tokens=int((positions < self.prompt_lens.numpy()[token_slot]).sum()),
            num_proposed=num_proposed,
            verify_tokens=verify_tokens,
        )

    def sampling_batch(self, batch: ForwardBatch, plan: StepPlan | None = None) -> SamplingBatch:
        """The sampling inputs of the batch's sampling rows; with the allowed-token masks
        of `plan` (the validated step the batch was prepared from) when it has some."""
        b = self.sampling_rows(batch.slots[batch.sample_rows])
        if plan is not None and plan.allowed_words is not None:
            row_of = {batch.ids[r]: i for i, r in enumerate(batch.sample_rows.tolist())}
            b.allowed_rows = torch.tensor([row_of[i] for i in plan.allowed_ids])
            b.allowed_words = plan.allowed_words
        return b

    def sampling_rows(self, slots: torch.Tensor) -> SamplingBatch:
        """The sampling inputs of the requests in `slots` for the token after their known
        ones (no allowed-token masks); gathered through numpy views, as `prepare`."""
        at = slots.numpy()
        params = self.params.numpy()[at]
        features = frozenset(f for f, c in self.features.items() if c > 0)
        penalties = PENALTY in features
        seq_lens = torch.from_numpy(self.seq_lens.numpy()[at])
        bias_rows = bias_ids = bias_values = None
        if LOGIT_BIAS in features:
            biased = [
                (i, self.logit_bias[s]) for i, s in enumerate(at.tolist()) if s in self.logit_bias
            ]
            if biased:
                bias_rows = torch.cat([torch.full_like(b[0], i) for i, b in biased])
                bias_ids = torch.cat([b[0] for _, b in biased])
                bias_values = torch.cat([b[1] for _, b in biased])
        return SamplingBatch(
            params=torch.from_numpy(params),
            seeds=torch.from_numpy(self.seeds.numpy()[at]),
            positions=seq_lens,
            history=self.tokens[slots, : int(seq_lens.max())] if penalties else None,
            seq_lens=seq_lens if penalties else None,
            prompt_lens=self.prompt_lens[slots] if penalties else None,
            features=features,
            any_sample=bool(params[:, DO_SAMPLE].any()),
            max_top_n=int(params[:, TOP_N].max()) if len(at) else 0,
            bias_rows=bias_rows,
            bias_ids=bias_ids,
            bias_values=bias_values,
        )

    def commit(self, batch: ForwardBatch, sampled: torch.Tensor) -> None:
        """After a successful forward: advance computed counts, append sampled tokens."""
        at = batch.slots.numpy()
        self.computed.numpy()[at] = batch.layout.context_lens.numpy()
        if sampled.numel() == 0:
            return
        slots = at[batch.sample_rows.numpy()]
        seq_lens = self.seq_lens.numpy()
        lens = seq_lens[slots]
        self.tokens = _grown(self.tokens, self.tokens.shape[0], int(lens.max()) + 1)
        self.tokens.numpy()[slots, lens] = sampled.numpy()
        seq_lens[slots] = lens + 1

    def proposals_of(self, batch: ForwardBatch) -> torch.Tensor:
        """[sum k]: the proposals of the batch's sampling rows, rows in order (the last k
        of each row's known tokens)."""
        assert batch.num_proposed is not None
        k = batch.num_proposed
        slots = batch.slots[batch.sample_rows]
        rows = torch.repeat_interleave(torch.arange(len(k)), k)
        first = self.seq_lens[slots] - k
        return self.tokens[slots[rows], first[rows] + offsets_within(k)]

    def commit_verified(
        self, batch: ForwardBatch, tokens: torch.Tensor, accepted: torch.Tensor
    ) -> None:
        """After a speculative step's verification: `accepted` [R] proposals kept per
        sampling row (0 for rows without), `tokens` [sum(1 + accepted)] the rows' answers
        s_0..s_a in row order. Each row keeps its tokens up to its last sampled one (p),
        then its answer; its computed count becomes p + 1 + a and a row that proposed cuts
        its block table to the blocks those tokens fill."""
        assert batch.num_proposed is not None
        self.computed[batch.slots] = batch.layout.context_lens
        slots = batch.slots[batch.sample_rows]
        proposed = batch.num_proposed
        after_t = self.seq_lens[slots] - proposed  # p + 1
        computed = after_t + accepted
        self.computed[slots] = computed
        counts = accepted + 1
        rows = torch.repeat_interleave(torch.arange(len(slots)), counts)
        positions = after_t[rows] + offsets_within(counts)
        self.tokens = _grown(self.tokens, self.tokens.shape[0], int(positions.max()) + 1)
        self.tokens[slots[rows], positions] = tokens.to(self.tokens.device)
        self.seq_lens[slots] = after_t + counts
        bs = self.block_size
        cut = torch.minimum(self.num_block_ids[slots], (computed + bs - 1) // bs)
        self.num_block_ids[slots] = torch.where(proposed > 0, cut, self.num_block_ids[slots])
        self.proposed.clear()
