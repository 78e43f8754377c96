//! Step building: the running requests' decodes and prefill chunks, the blocks they take,
//! and the `StepRequest` diff the shards apply.

use crate::blocks::{chain_seed, RequestId};
use crate::pb;

use super::sequence::{Proposal, Sequence};
use super::{Schedule, Scheduler};

/// One request's share of the step being built.
pub(super) struct Planned {
    pub(super) id: RequestId,
    pub(super) n: usize,
    /// Proposals among the `n` tokens (speculative decoding): all but the first.
    pub(super) proposal: Proposal,
}

/// The step under construction: who computes how many tokens, the block moves it carries,
/// the token budget left, and what the schedule reports.
pub(super) struct StepPlan {
    pub(super) budget: usize,
    pub(super) requests: Vec<Planned>,
    pub(super) copies: Vec<pb::BlockCopy>,
    pub(super) swap_out: Vec<pb::BlockCopy>,
    pub(super) swap_in: Vec<pb::BlockCopy>,
    /// Adapters paged in for the requests this step admits.
    pub(super) adapters_in: Vec<pb::AdapterPages>,
    pub(super) out: Schedule,
}

impl StepPlan {
    fn new(budget: usize) -> Self {
        Self {
            budget,
            requests: Vec::new(),
            copies: Vec::new(),
            swap_out: Vec::new(),
            swap_in: Vec::new(),
            adapters_in: Vec::new(),
            out: Schedule::default(),
        }
    }

    /// Whether this step preempted a running request for lack of blocks (not counting
    /// the policy's displacements, made so that a waiting request joins).
    pub(super) fn preempted(&self) -> bool {
        self.out.preempted.len() + self.out.swapped_out.len() > self.out.displaced
    }
}

/// The chunk rule: of `remaining` tokens to compute, as many as `budget` allows, and at
/// most `max_prefill_chunk` (0: no limit) unless it is a single token (a decode).
pub(super) fn chunk_len(remaining: usize, budget: usize, max_prefill_chunk: usize) -> usize {
    let n = remaining.min(budget);
    if remaining > 1 && max_prefill_chunk > 0 {
        n.min(max_prefill_chunk)
    } else {
        n
    }
}

impl Scheduler {
    /// Starts a step: the previous one has run, so its blocks are hit-able and its
    /// swapped-in host blocks free.
    pub(super) fn begin_step(&mut self) -> StepPlan {
        self.blocks.mark_ready();
        self.host.step_ran();
        StepPlan::new(self.config.max_batch_tokens)
    }

    /// Tokens of `seq`'s next chunk within `budget`.
    pub(super) fn chunk(&self, seq: &Sequence, budget: usize) -> usize {
        chunk_len(seq.remaining(), budget, self.config.max_prefill_chunk)
    }

    /// Most tokens `seq` can compute from its current position with the free blocks.
    fn fits(&self, seq: &Sequence) -> usize {
        let capacity =
            (self.blocks.table(seq.id).len() + self.blocks.num_free()) * self.blocks.block_size();
        capacity.saturating_sub(seq.num_computed)
    }

    /// Whether the running decodes need more blocks (new ones, copies) than are free, or
    /// leave none for a running prefill.
    pub(super) fn short_of_blocks(&self) -> bool {
        let mut need = 0;
        let mut prefilling = false;
        for seq in &self.running {
            let (id, from) = (seq.id, seq.num_computed);
            match seq.remaining() {
                1 if !seq.at_limit() => {
                    need += self.blocks.copies_needed(id, from, from + 1)
                        + self.blocks.missing_for(id, from + 1);
                }
                0 | 1 => {}
                _ => prefilling = true,
            }
        }
        let free = self.blocks.num_free();
        need > free || (prefilling && need == free)
    }

    /// Plans one token for each running request from the `from`-th on that has caught
    /// up (oldest first), taking a block when its last is full. Stops at the first that
    /// is short of blocks and returns its index.
    pub(super) fn plan_decodes(&mut self, plan: &mut StepPlan, from: usize) -> Option<usize> {
        let mut i = from;
        while i < self.running.len() && plan.budget > 0 {
            let seq = &self.running[i];
            if seq.remaining() == 1 && !seq.at_limit() {
                if !self.take_blocks(i, 1, &mut plan.copies) {
                    return Some(i);
                }
                self.plan_tokens(plan, self.running[i].id, 1);
            }
            i += 1;
        }
        None
    }

    /// Plans the next prompt chunk of each running request from the `from`-th on that
    /// has more than one token to compute (oldest first), shrunk to the free blocks
    /// rather than preempting. Stops at the first that cannot get even one block and
    /// returns its index.
    pub(super) fn plan_prefills(&mut self, plan: &mut StepPlan, from: usize) -> Option<usize> {
        let mut i = from;
        while i < self.running.len() && plan.budget > 0 {
            let seq = &self.running[i];
            if seq.remaining() > 1 {
                let id = seq.id;
                let mut n = self.chunk(seq, plan.budget);
                let fits = self.fits(seq);
                if fits > 0 && fits < n {
                    n = fits;
                }
                if fits == 0 || !self.take_blocks(i, n, &mut plan.copies) {
                    return Some(i);
                }
                self.plan_tokens(plan, id, n);
            }
            i += 1;
        }
        None
    }

    /// Takes the blocks (and copy-on-write copies) running request `i` needs to compute
    /// `n` more tokens. All or nothing.
    fn take_blocks(&mut self, i: usize, n: usize, copies: &mut Vec<pb::BlockCopy>) -> bool {
        let (id, from) = (self.running[i].id, self.running[i].num_computed);
        let copies_needed = self.blocks.copies_needed(id, from, from + n);
        if copies_needed > 0 && self.running[i].pending > 0 && self.running[i].on_shard {
            return false; // a copy re-joins the request, which needs its pending token
        }
        let need = copies_needed + self.blocks.missing_for(id, from + n);
        if need > self.blocks.num_free() {
            return false;
        }
        let made = self
            .blocks
            .prepare_write(id, from, from + n)
            .expect("checked");
        if !made.is_empty() && self.running[i].on_shard {
            // A table entry changed and the diff can only append: the shards drop the
            // request and take it back (same step, removals first) with its new table.
            let seq = &mut self.running[i];
            seq.on_shard = false;
            seq.blocks_sent = 0;
            self.removed.push(id);
        }
        copies.extend(
            made.into_iter()
                .map(|(src, dst)| pb::BlockCopy { src, dst }),
        );
        self.blocks.grow_to(id, from + n)
    }

    /// Adds `n` tokens of running request `id` to the step, within its budget, and
    /// enters the full blocks they complete in the prefix cache (hit-able once the step
    /// has run).
    pub(super) fn plan_tokens(&mut self, plan: &mut StepPlan, id: RequestId, n: usize) {
        plan.requests.push(Planned {
            id,
            n,
            proposal: Proposal::None,
        });
        plan.budget -= n;
        let i = self
            .running_index(id)
            .expect("planned requests are running");
        let seq = &self.running[i];
        let seed = chain_seed(&seq.adapter_id);
        self.blocks
            .register_full(id, &seq.token_ids, seq.num_computed + n, seed);
    }

    /// The step's diff (4th in the module documentation), when it computes or moves
    /// anything (blocks, or adapters out of the pool); else the removals wait for the next
    /// real step.
    pub(super) fn build_step(&mut self, plan: StepPlan) -> Schedule {
        let StepPlan {
            requests,
            copies,
            swap_out,
            swap_in,
            adapters_in,
            mut out,
            ..
        } = plan;
        self.adapters_out.extend(self.blocks.take_evicted());
        if requests.is_empty() && swap_out.is_empty() && self.adapters_out.is_empty() {
            return out;
        }
        let mut step = pb::StepRequest {
            step_id: self.step_id,
            removed: std::mem::take(&mut self.removed),
            copies,
            swap_out,
            swap_in,
            adapters_out: std::mem::take(&mut self.adapters_out),
            adapters_in,
            ..Default::default()
        };
        self.step_id += 1;
        for Planned { id, n, proposal } in requests {
            let proposed = proposal.len();
            let i = self
                .running_index(id)
                .expect("planned requests are running");
            let sampled = {
                let s = &self.running[i];
                s.num_computed + n - proposed == s.token_ids.len() + s.pending
            };
            self.charge(i, n - proposed, usize::from(sampled));
            let table = self.blocks.table(id);
            let seq = &mut self.running[i];
            if seq.on_shard {
                let forced_from = seq.token_ids.len() - seq.forced_unsent;
                let mut continuing = pb::ContinuingRequest {
                    id,
                    num_compute: n as u32,
                    new_blocks: table[seq.blocks_sent..].to_vec(),
                    forced_tokens: seq.token_ids[forced_from..].to_vec(),
                    ..Default::default()
                };
                match proposal {
                    Proposal::None => {}
                    Proposal::Tokens(tokens) => continuing.proposed_tokens = tokens,
                    Proposal::Draft(k) => continuing.num_draft_tokens = k as u32,
                }
                step.continuing.push(continuing);
            } else {
                step.joined.push(pb::NewRequest {
                    id,
                    token_ids: seq.token_ids.clone(),
                    prompt_len: seq.prompt_len as u32,
                    num_cached: seq.num_computed as u32,
                    num_compute: n as u32,
                    block_table: table.to_vec(),
                    sampling: Some(seq.sampling.clone()),
                    top_n_tokens: seq.top_n_tokens,
                    adapter_id: seq.adapter_id.clone(),
                    // Delivered with the first sampled token, so not again after that.
                    prompt_logprobs: seq.prompt_logprobs && seq.num_generated() == 0,
                    request_id: seq.request_id.to_string(),
                });
                seq.on_shard = true;
            }
            seq.forced_unsent = 0;
            seq.blocks_sent = table.len();
            // Proposals count as computed only once verified.
            seq.num_computed += n - proposed;
            seq.verifying = proposed;
            out.num_tokens += n;
            if seq.num_computed == seq.token_ids.len() + seq.pending {
                out.samples.push(id);
            }
        }
        out.step = Some(step);
        out
    }
}
