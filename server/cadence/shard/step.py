"""One Step on the shard, start to answer: apply the checked diff, propose with the draft
model (when asked), one forward over every scheduled token, then sample (under a
constrained request's allowed-token mask, when the step has one) or, for a step with
speculative rows, take the logits at every proposal's position and verify them
(`cadence.speculative.verify`). What computes each part was chosen once, at load
(`cadence.shard.backends`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from cadence.heartbeat import HEARTBEAT
from cadence.kv_cache import KVCache
from cadence.layers.kernel_ops import LayerOps
from cadence.pb import shard_pb2
from cadence.runners import ModelRunner
from cadence.sampling import DO_SAMPLE, TOP_N, SamplingBatch, sample
from cadence.shard import generations
from cadence.shard.adapters import ShardAdapters
from cadence.shard.forward_batch import ForwardBatch
from cadence.shard.state import BatchState
from cadence.shard.step_checks import StepPlan, check_step
from cadence.speculative.verify import expand, verify

if TYPE_CHECKING:
    from cadence.speculative.draft import DraftModel, DraftProposals

# the SamplingBatch tensors a device other than the CPU gets a copy of
_SAMPLING_TENSORS = (
    "params", "seeds", "positions", "history", "seq_lens", "prompt_lens",
    "bias_rows", "bias_ids", "bias_values", "allowed_rows", "allowed_words",
)  # fmt: skip


@dataclass(slots=True)
class StepCounts:
    """Cumulative counts of what the forwards computed (HealthResponse), warm-up's
    included."""

    computed_tokens: int = 0
    prompt_tokens: int = 0


class StepRunner:
    """Runs Steps on the model the engine loaded, with the kernels it chose."""

    def __init__(
        self,
        model: nn.Module,
        runner: ModelRunner,
        ops: LayerOps,
        adapters: ShardAdapters,
        draft: DraftModel | None,
        device: torch.device,
        speculative_acceptance: float,
    ) -> None:
        self.model = model
        self.runner = runner
        self.ops = ops
        self.adapters = adapters
        self.draft = draft
        self.device = device
        self.speculative_acceptance = speculative_acceptance
        # host blocks the router swaps into (WarmupRequest.swap_blocks), set at warm-up
        self.host_blocks = 0
        self.counts = StepCounts()

    def run(
        self, req: shard_pb2.StepRequest, state: BatchState, kv: KVCache
    ) -> shard_pb2.StepResponse:
        plan = self.apply(req, state, kv)
        if not plan.rows:
            return shard_pb2.StepResponse()
        started = time.perf_counter_ns()
        drafted = self._propose(plan, state) if plan.drafts else None
        batch = state.prepare(plan.rows)
        # The sampling inputs do not depend on the forward: gathered now, while the
        # state's tensors and this code are still in cache (after the forward's stream
        # of weights and KV blocks the same gathers took several times as long).
        sb = None
        if batch.num_proposed is None and batch.sample_rows.numel():
            sb = self.on_device(state.sampling_batch(batch, plan))
        hidden = self.forward(batch, state)
        if state.prompt_logprobs:
            generations.gather_prompt_logprobs(batch, state, hidden, self.model.compute_logits)
        HEARTBEAT.beat()
        self.counts.computed_tokens += batch.num_tokens
        self.counts.prompt_tokens += batch.num_prompt_tokens
        response = shard_pb2.StepResponse(computed_tokens=batch.num_tokens)
        answers = response.generations
        if batch.num_proposed is not None:
            answers.extend(self._verify(batch, plan, state, hidden, drafted))
        elif sb is not None:
            logits = self.model.compute_logits(hidden[batch.sample_tokens.to(self.device)])
            out = sample(logits, sb, self.ops.greedy)
            ids = out.ids.cpu()
            state.commit(batch, ids)
            generations.sampled(batch, sb, ids, out, answers)
        else:
            state.commit(batch, torch.empty(0, dtype=torch.long))
        if state.prompt_logprobs:
            generations.attach_prompt_logprobs(state, answers)
        response.forward_ns = time.perf_counter_ns() - started
        return response

    def apply(self, req: shard_pb2.StepRequest, state: BatchState, kv: KVCache) -> StepPlan:
        """Checks the diff, then applies it in the contract's order: drop `removed`,
        swap-out, swap-in, block copies, LoRA adapters out of and into the pool, add
        `joined`, extend `continuing` tables and append their forced tokens and the
        router's proposals. The plan keeps the step's allowed-token masks for sampling and
        the requests the draft model proposes for."""
        plan = check_step(state, req, self.host_blocks, draft_model=self.draft is not None)
        self.adapters.check(req, state)
        state.remove(plan.removed)
        # Swap-out first: the router may hand the blocks it frees to this very step.
        kv.swap_out([c.src for c in req.swap_out], [c.dst for c in req.swap_out])
        kv.swap_in([c.src for c in req.swap_in], [c.dst for c in req.swap_in])
        kv.copy_blocks([c.src for c in req.copies], [c.dst for c in req.copies])
        self.adapters.page(req.adapters_out, req.adapters_in)
        state.apply(plan, list(req.continuing))
        if self.draft is not None and plan.joined:  # a reused slot's draft KV is stale
            self.draft.forget([state.slot_of[r.id] for r in plan.joined])
        return plan

    def forward(self, batch: ForwardBatch, state: BatchState) -> torch.Tensor:
        """One forward over the flat batch -> hidden states [T, hidden], each request's
        rows through its LoRA adapter when it has one."""
        d = self.device
        layout = batch.layout.to(d)
        with self.adapters.step(batch, state):
            return self.runner.forward(layout, batch.input_ids.to(d), batch.positions.to(d))

    def on_device(self, b: SamplingBatch) -> SamplingBatch:
        if self.device.type == "cpu":
            return b
        for name in _SAMPLING_TENSORS:
            t = getattr(b, name)
            if t is not None:
                setattr(b, name, t.to(self.device, non_blocking=True))
        return b

    def _propose(self, plan: StepPlan, state: BatchState) -> DraftProposals:
        """The draft model's proposals for the plan's draft rows, appended to their tokens."""
        assert self.draft is not None
        rows = [(state.slot_of[i], k) for i, k in plan.drafts]
        sampling = self.on_device(state.sampling_rows(torch.tensor([s for s, _ in rows])))
        drafted = self.draft.propose(state, rows, sampling)
        assert [len(t) for t in drafted.tokens] == [k for _, k in plan.drafts]
        state.append_proposed({i: t for (i, _), t in zip(plan.drafts, drafted.tokens, strict=True)})
        return drafted

    def _verify(
        self,
        batch: ForwardBatch,
        plan: StepPlan,
        state: BatchState,
        hidden: torch.Tensor,
        drafted: DraftProposals | None,
    ) -> list[shard_pb2.Generation]:
        """Verifies a speculative step's sampling rows, commits what they keep and answers
        them. Router proposals are sampled and matched (or accepted at the set rate, for
        benchmarks); draft proposals too in greedy rows, and rejection-sampled against the
        draft's distributions in sampling rows."""
        assert batch.num_proposed is not None and batch.verify_tokens is not None
        k = batch.num_proposed
        logits = self.model.compute_logits(hidden[batch.verify_tokens.to(self.device)])
        sb = state.sampling_batch(batch, plan)
        top_n = sb.params[:, TOP_N].long().tolist()
        ids = [batch.ids[r] for r in batch.sample_rows.tolist()]
        synthetic = torch.tensor([i in plan.proposals for i in ids], dtype=torch.bool)
        if self.speculative_acceptance <= 0:
            synthetic[:] = False
        rejection = torch.zeros(len(ids), dtype=torch.bool)
        q = None
        if drafted is not None and drafted.q_logprobs is not None:
            # each draft row's q rows, found by request id (propose saw the plan's order)
            starts, at = 0, {}
            for i, n in plan.drafts:
                at[i] = torch.arange(starts, starts + n)
                starts += n
            rejection = torch.tensor([i in at for i in ids]) & sb.params[:, DO_SAMPLE].bool()
            picked = [at[i] for i, r in zip(ids, rejection.tolist(), strict=True) if r]
            if picked:
                q = drafted.q_logprobs[torch.cat(picked).to(drafted.q_logprobs.device)]
        v = verify(
            logits, self.on_device(expand(sb, k)), k, state.proposals_of(batch), synthetic,
            self.speculative_acceptance, rejection, q, self.ops.greedy,
            synthetic_keys=torch.tensor(ids, dtype=torch.long),
        )  # fmt: skip
        state.commit_verified(batch, v.tokens, v.accepted)
        if self.draft is not None and plan.drafts:
            slots = [state.slot_of[i] for i, _ in plan.drafts]
            self.draft.accepted(slots, state.computed[slots].tolist())
        return generations.verified(ids, k, v, top_n)
