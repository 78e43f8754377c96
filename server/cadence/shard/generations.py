"""A step's answers: one `Generation` per sampling row (its tokens, logprobs and top
alternatives; under speculation the proposal counts too), and the prompt logprobs a
request asked for, gathered chunk by chunk and sent once with its first token."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from google.protobuf.internal.containers import RepeatedCompositeFieldContainer

from cadence.pb import shard_pb2
from cadence.sampling import TOP_N, SampleOutput, SamplingBatch
from cadence.shard.forward_batch import ForwardBatch
from cadence.shard.state import BatchState
from cadence.speculative.verify import Verified


def sampled(
    batch: ForwardBatch,
    sb: SamplingBatch,
    ids: torch.Tensor,
    out: SampleOutput,
    into: RepeatedCompositeFieldContainer[shard_pb2.Generation],
) -> None:
    """One Generation per sampling row of a plain step, added to `into` (the response's
    field: added in place, not built apart and copied in): its token and logprob, and its
    top alternatives when it asked for them."""
    rows = batch.sample_rows.tolist()
    tokens = ids.tolist()
    logprobs = out.logprobs.tolist()
    top_ids = top_lps = top_n = None
    if out.top_ids is not None:
        top_ids = out.top_ids.tolist()
        top_lps = out.top_logprobs.tolist()
        top_n = sb.params[:, TOP_N].long().tolist()
    add = into.add
    for i, row in enumerate(rows):
        g = add(id=batch.ids[row], token_ids=[tokens[i]], logprobs=[logprobs[i]])
        if top_n is not None and top_n[i] > 0:
            n = top_n[i]
            g.top_tokens.append(shard_pb2.TopTokens(ids=top_ids[i][:n], logprobs=top_lps[i][:n]))


def verified(
    ids: list[int], num_proposed: torch.Tensor, v: Verified, top_n: list[int]
) -> list[shard_pb2.Generation]:
    """One Generation per sampling row of a speculative step: its 1 + accepted tokens,
    their logprobs and top alternatives, and the proposal counts."""
    tokens, logprobs = v.tokens.tolist(), v.logprobs.tolist()
    top_ids = top_lps = None
    if v.top_ids is not None and v.top_logprobs is not None:
        top_ids, top_lps = v.top_ids.tolist(), v.top_logprobs.tolist()
    gens, start = [], 0
    for i, k, a, n in zip(ids, num_proposed.tolist(), v.accepted.tolist(), top_n, strict=True):
        end = start + 1 + a
        g = shard_pb2.Generation(
            id=i,
            token_ids=tokens[start:end],
            logprobs=logprobs[start:end],
            num_proposed=k,
            num_accepted=a,
        )
        if top_ids is not None and top_lps is not None and n > 0:
            g.top_tokens.extend(
                shard_pb2.TopTokens(ids=top_ids[t][:n], logprobs=top_lps[t][:n])
                for t in range(start, end)
            )
        gens.append(g)
        start = end
    return gens


def gather_prompt_logprobs(
    batch: ForwardBatch,
    state: BatchState,
    hidden: torch.Tensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """Logprobs of the prompt tokens this step's chunk predicts, for the requests that
    asked: the raw model distribution (no penalties, bias or warpers)."""
    starts = batch.layout.query_start.tolist()
    ends = batch.layout.context_lens.tolist()
    for row, slot in enumerate(batch.slots.tolist()):
        acc = state.prompt_logprobs.get(slot)
        if acc is None or acc.sent:
            continue
        n = starts[row + 1] - starts[row]
        first = ends[row] - n  # position of the chunk's first token
        prompt_len = int(state.prompt_lens[slot])
        count = min(n, prompt_len - 1 - first)  # positions whose next token is prompt
        if count <= 0:
            continue
        flat = hidden[starts[row] : starts[row] + count]
        logprobs = compute_logits(flat).float().log_softmax(dim=-1)
        targets = state.tokens[slot, first + 1 : first + 1 + count].to(logprobs.device)
        acc.logprobs += logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
        top_n = int(state.params[slot, TOP_N])
        if top_n > 0:
            values, ids = logprobs.topk(min(top_n, logprobs.shape[1]), dim=-1)
            acc.top_ids += ids.tolist()
            acc.top_logprobs += values.tolist()


def attach_prompt_logprobs(state: BatchState, generations: Iterable[shard_pb2.Generation]) -> None:
    """Sends each request's prompt logprobs once, with its first sampled token."""
    for g in generations:
        acc = state.prompt_logprobs.get(state.slot_of[g.id])
        if acc is None or acc.sent:
            continue
        g.prompt_logprobs.extend(acc.logprobs)
        for ids, lps in zip(acc.top_ids, acc.top_logprobs, strict=True):
            g.prompt_top_tokens.append(shard_pb2.TopTokens(ids=ids, logprobs=lps))
        acc.sent = True
        acc.logprobs, acc.top_ids, acc.top_logprobs = [], [], []
