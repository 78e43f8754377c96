//! Requests leaving the batch: finished, failed, or preempted to make room. Each gives
//! back what it holds through one release.

use std::time::Instant;

use crate::blocks::RequestId;

use super::sequence::{Proposal, Sequence};
use super::step::StepPlan;
use super::{Preemption, Scheduler};

impl Scheduler {
    /// Gives back what `seq` (already out of `running` or the queue) holds: if it was
    /// running, its adapter reference, its KV blocks and its state on the shards (dropped
    /// at the next step); if it was swapped out, its host blocks.
    fn release(&mut self, seq: &mut Sequence, was_running: bool) {
        if was_running {
            self.leave_adapter(seq);
            self.blocks.free(seq.id);
            if seq.on_shard {
                self.removed.push(seq.id);
            }
        }
        self.host.give_back(&mut seq.swapped);
    }

    /// Retires a request (finished, cancelled or failed): frees its blocks now and tells
    /// the shards to drop its state at the next step.
    pub fn finish(&mut self, id: RequestId) -> Option<Sequence> {
        let (mut seq, running) = match self.running_index(id) {
            Some(i) => (self.running.remove(i), true),
            None => (self.waiting.remove(id)?, false),
        };
        self.release(&mut seq, running);
        Some(seq)
    }

    /// Drops a waiting request admission refused (`Schedule::refused`).
    pub(super) fn refuse(&mut self, mut seq: Sequence) {
        self.release(&mut seq, false);
    }

    /// Drops a running request that cannot fit even with the whole cache to itself.
    fn fail(&mut self, mut seq: Sequence, plan: &mut StepPlan) {
        self.release(&mut seq, true);
        plan.out.failed.push(seq.id);
    }

    /// Preempts `seq` (already out of `running`): by swapping when asked and the host
    /// pool has room, else by recomputation.
    pub(super) fn preempt(&mut self, mut seq: Sequence, plan: &mut StepPlan) {
        let table = self.blocks.table(seq.id);
        let swapped = match self.config.preemption {
            Preemption::Swap if seq.on_shard && !table.is_empty() => {
                self.host.swap_out(table, &mut plan.swap_out)
            }
            _ => None,
        };
        self.release(&mut seq, true);
        seq.on_shard = false;
        seq.blocks_sent = 0;
        seq.proposal = Proposal::None;
        seq.num_preemptions += 1;
        match swapped {
            Some(swapped) => {
                seq.swapped = swapped;
                plan.out.swapped_out.push(seq.id);
            }
            None => {
                seq.num_computed = 0;
                plan.out.preempted.push(seq.id);
            }
        }
        self.waiting.push_front(seq);
    }

    /// Frees blocks for running request `i`'s decode by preempting the request the policy
    /// ranks last among `i` and those after it (not yet planned; `fcfs`: the latest
    /// arrival, possibly `i` itself); fails `i` when it is alone and still short.
    pub(super) fn preempt_latest(&mut self, i: usize, plan: &mut StepPlan, now: Instant) {
        let id = self.running[i].id;
        let v = self
            .victim(now, |v| v >= i)
            .expect("running[i] is eligible");
        let victim = self.running.remove(v);
        if victim.id == id && self.running.is_empty() {
            self.fail(victim, plan);
        } else {
            self.preempt(victim, plan);
        }
    }

    /// Running request `i`'s prefill has no block: preempts a request that ranks after it
    /// and has nothing planned (`fcfs`: a later arrival), or fails `i` when it is alone,
    /// or leaves it to wait for decodes to finish (they preempt when they need to).
    /// Returns where the prefills go on.
    pub(super) fn make_room_for_prefill(
        &mut self,
        i: usize,
        plan: &mut StepPlan,
        now: Instant,
    ) -> usize {
        let victim = self.victim(now, |v| {
            v != i
                && self.ranks_after(v, i, now)
                && !plan.requests.iter().any(|p| p.id == self.running[v].id)
        });
        match victim {
            Some(v) => {
                let victim = self.running.remove(v);
                self.preempt(victim, plan);
                if v < i {
                    i - 1
                } else {
                    i
                }
            }
            None if self.running.len() == 1 => {
                let seq = self.running.remove(i);
                self.fail(seq, plan);
                i
            }
            None => i + 1,
        }
    }
}
