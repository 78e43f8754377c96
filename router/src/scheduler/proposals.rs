//! Speculative decoding's part of a step: how much of a decoding request's `Proposal`
//! goes into the step, and what the shards' verification leaves of it.

use crate::blocks::RequestId;

use super::sequence::Proposal;
use super::step::StepPlan;
use super::Scheduler;

impl Scheduler {
    /// Sets what running request `id` proposes at its next decode (speculative decoding);
    /// the next schedule uses it or drops it.
    pub fn propose(&mut self, id: RequestId, proposal: Proposal) {
        if let Some(i) = self.running_index(id) {
            self.running[i].proposal = proposal;
        }
    }

    /// The shards verified the proposals `id` carried in the step just answered: `accepted`
    /// of them (leading) count as computed, and the blocks past its computed tokens (held
    /// for the rejected ones) are released, as the shards cut the table. Call before
    /// `append_tokens` brings the tokens. Err when the answer does not fit what was sent.
    pub fn verified(&mut self, id: RequestId, accepted: usize) -> Result<(), String> {
        let Some(i) = self.running_index(id) else {
            return Ok(()); // finished or cancelled meanwhile
        };
        let seq = &mut self.running[i];
        if accepted > seq.verifying {
            return Err(format!(
                "{accepted} proposals accepted of the {} sent",
                seq.verifying
            ));
        }
        seq.num_computed += accepted;
        seq.verifying = 0;
        let keep = self.blocks.blocks_for(seq.num_computed);
        self.blocks.truncate(id, keep);
        seq.blocks_sent = seq.blocks_sent.min(keep);
        // Accepted proposals are generated tokens, charged as such (`fair`).
        self.charge(i, 0, accepted);
        Ok(())
    }

    /// Adds each planned decode's proposal (oldest first) while the step stays within
    /// `speculative_max_step_tokens` and the budget, the request's token limit and the free
    /// blocks allow (no copy, no preemption for a proposal). With speculation on, every
    /// request's proposal is consumed: the loop sets a fresh one before each schedule.
    pub(super) fn add_proposals(&mut self, plan: &mut StepPlan) {
        let limit = self.config.speculative_max_step_tokens;
        if limit == 0 {
            return; // speculation is off: nobody proposes
        }
        let mut total: usize = plan.requests.iter().map(|p| p.n).sum();
        for p in 0..plan.requests.len() {
            let id = plan.requests[p].id;
            let i = self
                .running_index(id)
                .expect("planned requests are running");
            let seq = &mut self.running[i];
            let proposal = std::mem::take(&mut seq.proposal);
            if plan.requests[p].n != 1 || !seq.decodes_next() || proposal.len() == 0 {
                continue;
            }
            let room = seq
                .max_new_tokens
                .saturating_sub(seq.num_generated() + 1)
                .min(plan.budget);
            let wanted = proposal.len().min(room);
            let k = wanted.min(limit.saturating_sub(total));
            if wanted > 0 && k == 0 {
                plan.out.speculation_off += 1;
            }
            let from = seq.num_computed;
            if k == 0
                || self.blocks.copies_needed(id, from, from + 1 + k) > 0
                || !self.blocks.grow_to(id, from + 1 + k)
            {
                continue;
            }
            plan.budget -= k;
            total += k;
            plan.requests[p].n += k;
            plan.requests[p].proposal = proposal.take(k);
            plan.out.speculating += 1;
            plan.out.proposed_tokens += k;
        }
    }
}
