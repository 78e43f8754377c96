"""The checks of a StepRequest against the shard's state (`BatchState`), made before
anything of it is applied: a diff that fails any of them is refused whole (`StepError`).
What passes becomes a `StepPlan`: the rows to compute, the allowed-token masks packed
for the sampler, and the speculative rows' proposals (the router's) or draft counts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from cadence.pb import shard_pb2

if TYPE_CHECKING:
    from cadence.shard.state import BatchState


class StepError(ValueError):
    """A malformed StepRequest; nothing of it has been applied. `request_id`: the id of the
    request at fault, for the log line, when one is."""

    def __init__(self, message: str, request_id: str = "") -> None:
        super().__init__(message)
        self.request_id = request_id


@dataclass(slots=True)
class StepPlan:
    removed: list[int] = field(default_factory=list)
    joined: list[shard_pb2.NewRequest] = field(default_factory=list)
    rows: list[tuple[int, int]] = field(default_factory=list)  # (request id, num_compute)
    # this step's allowed-token masks: the constrained requests' ids and their words
    # [M, ceil(vocab / 32)] int32, zero-padded (the tail is disallowed); None without any
    allowed_ids: list[int] = field(default_factory=list)
    allowed_words: torch.Tensor | None = None
    # speculative rows: the router's proposals by request id, and (id, k) of the
    # requests whose k proposals the draft model makes
    proposals: dict[int, list[int]] = field(default_factory=dict)
    drafts: list[tuple[int, int]] = field(default_factory=list)

    @property
    def speculative(self) -> bool:
        return bool(self.proposals or self.drafts)


def check_step(
    state: BatchState, req: shard_pb2.StepRequest, host_blocks: int, draft_model: bool = False
) -> StepPlan:
    """Checks the whole diff against `state` without changing anything. `host_blocks`:
    the router's host pool for swaps (WarmupRequest.swap_blocks); `draft_model`: whether
    this shard has one (for `num_draft_tokens`)."""
    nb = state.num_blocks
    plan = StepPlan(removed=list(req.removed))
    held = set(state.slot_of) - set(plan.removed)
    for kind, ops in (("copies", req.copies), ("swap_out", req.swap_out)):
        for op in ops:
            if op.src >= nb or (kind == "copies" and op.dst >= nb):
                raise StepError(f"{kind}: block {op.src}->{op.dst} out of range ({nb})")
    for op in req.swap_out:
        if op.dst >= host_blocks:
            raise StepError(f"swap_out: host block {op.dst} >= {host_blocks}")
    for op in req.swap_in:
        if op.dst >= nb or op.src >= host_blocks:
            raise StepError(f"swap_in: block {op.src}->{op.dst} out of range")
    bs = state.block_size
    for r in req.joined:
        n = len(r.token_ids)
        if r.id in held:
            raise StepError(f"request {r.id} joined but is already held", request_id=r.request_id)
        if n == 0 or r.prompt_len > n or r.num_cached + r.num_compute > n:
            raise StepError(
                f"request {r.id}: {n} tokens, prompt_len {r.prompt_len}, "
                f"num_cached {r.num_cached} + num_compute {r.num_compute}",
                request_id=r.request_id,
            )
        if len(r.block_table) * bs < r.num_cached + r.num_compute:
            raise StepError(
                f"request {r.id}: {len(r.block_table)} blocks are too few",
                request_id=r.request_id,
            )
        if r.block_table and max(r.block_table) >= nb:
            raise StepError(
                f"request {r.id}: block {max(r.block_table)} >= {nb}", request_id=r.request_id
            )
        if max(r.token_ids) >= state.vocab_size:
            raise StepError(
                f"request {r.id}: token id {max(r.token_ids)} >= vocab", request_id=r.request_id
            )
        if r.sampling.logit_bias and max(r.sampling.logit_bias) >= state.vocab_size:
            raise StepError(f"request {r.id}: logit_bias token >= vocab", request_id=r.request_id)
        if r.prompt_logprobs and r.num_cached > 0:
            raise StepError(
                f"request {r.id}: prompt_logprobs needs num_cached = 0", request_id=r.request_id
            )
        held.add(r.id)
        if r.num_compute > 0:
            plan.rows.append((r.id, r.num_compute))
    plan.joined = list(req.joined)
    cont: list[shard_pb2.ContinuingRequest] = []
    # of each continuing request that computes: its slot, num_compute, new blocks, the
    # tokens it adds to what it knows (forced, proposed, drafted) and whether it speculates
    slots: list[int] = []
    counts: list[int] = []
    new_blocks: list[int] = []
    added: list[int] = []
    speculating: list[bool] = []
    joined_ids = {r.id for r in req.joined}
    continuing_ids: set[int] = set()
    for c in req.continuing:  # each field read once: a decode step has a few dozen
        cid, blocks, forced = c.id, c.new_blocks, c.forced_tokens
        proposed, drafts = c.proposed_tokens, c.num_draft_tokens
        if cid not in held or cid in joined_ids:
            raise StepError(
                f"continuing request {cid} is not held", request_id=state.request_id(cid)
            )
        if cid in continuing_ids:
            raise StepError(
                f"continuing request {cid} is listed twice", request_id=state.request_id(cid)
            )
        continuing_ids.add(cid)
        if blocks and max(blocks) >= nb:
            raise StepError(
                f"request {cid}: new block {max(blocks)} >= {nb}",
                request_id=state.request_id(cid),
            )
        if forced and max(forced) >= state.vocab_size:
            raise StepError(
                f"request {cid}: forced_tokens token id {max(forced)} >= vocab",
                request_id=state.request_id(cid),
            )
        if proposed or drafts:
            _check_proposals(state, c, plan, draft_model)
        num_compute = c.num_compute
        if num_compute > 0:
            plan.rows.append((cid, num_compute))
            cont.append(c)
            slots.append(state.slot_of[cid])
            counts.append(num_compute)
            new_blocks.append(len(blocks))
            added.append(len(forced) + len(proposed) + drafts)
            speculating.append(bool(proposed) or drafts > 0)
    if len({i for i, _ in plan.rows}) != len(plan.rows):
        raise StepError("a request is scheduled twice")
    if cont:
        # numpy views of the state's (CPU) tensors: a decode step's few dozen rows are
        # checked without torch calls, each of which would let the shard's other threads
        # take the GIL in the middle of the step's critical path.
        at = np.array(slots, dtype=np.int64)
        seq_lens, computed = state.seq_lens.numpy()[at], state.computed.numpy()[at]
        known = seq_lens + np.array(added, dtype=np.int64)
        end = computed + np.array(counts, dtype=np.int64)
        held_blocks = state.num_block_ids.numpy()[at] + np.array(new_blocks, dtype=np.int64)
        bad = (end > known) | (end > held_blocks * bs)
        if bad.any():
            c = cont[int(bad.argmax())]
            raise StepError(
                f"request {c.id}: num_compute {c.num_compute} exceeds its known tokens "
                "(with its forced or proposed tokens) or its blocks",
                request_id=state.request_id(c.id),
            )
        if plan.speculative:
            # proposals follow a token sampled by the request's previous step: the
            # only one it knows that is not computed
            bad = np.array(speculating) & (computed != seq_lens - 1)
            if bad.any():
                c = cont[int(bad.argmax())]
                raise StepError(
                    f"request {c.id}: proposals need a decoding request (every known "
                    "token computed but the last sampled one)",
                    request_id=state.request_id(c.id),
                )
    if req.allowed:  # the requests that sample this step may have a mask
        sampling = {
            r.id for r in req.joined if 0 < r.num_compute == len(r.token_ids) - r.num_cached
        }
        if cont:
            samples = (end == known).tolist()
            sampling.update(c.id for c, s in zip(cont, samples, strict=True) if s)
        plan.allowed_ids, plan.allowed_words = _allowed(
            state.vocab_size, req.allowed, held, sampling
        )
        masked = set(plan.allowed_ids) & (set(plan.proposals) | {i for i, _ in plan.drafts})
        if masked:
            raise StepError(
                f"allowed: request {min(masked)} has proposals (a mask constrains one position)"
            )
    return plan


def _check_proposals(
    state: BatchState, c: shard_pb2.ContinuingRequest, plan: StepPlan, draft_model: bool
) -> None:
    """One continuing request's proposals (the checks that need no state), entered in
    `plan`."""

    def fail(message: str) -> StepError:
        return StepError(f"request {c.id}: {message}", request_id=state.request_id(c.id))

    if c.proposed_tokens and c.num_draft_tokens:
        raise fail("proposed_tokens and num_draft_tokens together")
    if c.forced_tokens:
        raise fail("proposals (proposed_tokens / num_draft_tokens) with forced_tokens")
    k = len(c.proposed_tokens) or c.num_draft_tokens
    if c.num_compute != 1 + k:
        raise fail(f"num_compute {c.num_compute} is not 1 + {k} proposals")
    if c.num_draft_tokens:
        if not draft_model:
            raise fail("num_draft_tokens without a draft model on this shard")
        plan.drafts.append((c.id, k))
        return
    if max(c.proposed_tokens) >= state.vocab_size:
        raise fail(f"proposed_tokens token id {max(c.proposed_tokens)} >= vocab")
    plan.proposals[c.id] = list(c.proposed_tokens)


def _allowed(
    vocab: int, allowed: Sequence[shard_pb2.AllowedTokens], held: set[int], sampling: set[int]
) -> tuple[list[int], torch.Tensor]:
    """The step's masks checked -- one per request that samples this step, at most
    ceil(vocab / 32) words, at least one token allowed -- and packed into one
    zero-padded int32 tensor (each word's bits as they are)."""
    width = -(-vocab // 32)
    ids: list[int] = []
    seen: set[int] = set()
    words = torch.zeros(len(allowed), width, dtype=torch.int32)
    for i, a in enumerate(allowed):
        if a.id not in held:
            raise StepError(f"allowed: request {a.id} is not held")
        if a.id not in sampling:
            raise StepError(f"allowed: request {a.id} does not sample this step")
        if a.id in seen:
            raise StepError(f"allowed: request {a.id} has two masks")
        if len(a.words) % 4:
            raise StepError(
                f"allowed: request {a.id}'s words are {len(a.words)} bytes, not a multiple of 4"
            )
        if len(a.words) // 4 > width:
            raise StepError(
                f"allowed: request {a.id} has {len(a.words) // 4} words, more than the "
                f"{width} of its {vocab}-token logits"
            )
        if a.words:  # little-endian words, as this (x86 / arm64) host reads them
            packed = torch.frombuffer(bytearray(a.words), dtype=torch.int32)
            words[i, : packed.shape[0]] = packed
        ids.append(a.id)
        seen.add(a.id)
    # the bits past the vocabulary in the last word do not count as allowed tokens
    live = words[:, -1] & ((1 << (vocab % 32)) - 1) if vocab % 32 else words[:, -1]
    empty = ~((words[:, :-1] != 0).any(dim=1) | (live != 0))
    if bool(empty.any()):
        raise StepError(f"allowed: request {ids[int(empty.nonzero()[0, 0])]} allows no token")
    return ids, words
