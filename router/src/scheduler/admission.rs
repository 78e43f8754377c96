//! Admission: which waiting requests join the step, as the batching mode, the token
//! budget, the batch size, the free blocks and the LoRA adapter gate allow.

use std::collections::HashSet;
use std::time::Instant;

use crate::blocks::{chain_seed, PrefixMatch, RequestId};
use crate::pb;

use super::sequence::Sequence;
use super::step::{chunk_len, StepPlan};
use super::{Batching, Schedule, Scheduler};

/// What became of a waiting request the admission looked at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Admitted {
    Joined,
    /// Dropped: with its adapter it can never fit (`Schedule::refused`).
    Refused,
    /// Passed over, keeping its place: its adapter is still loading, or would be one
    /// adapter too many in the batch.
    Passed,
    /// Too few blocks (or its prefix is being computed): nothing behind it joins either.
    Wait,
}

impl Scheduler {
    /// Plans the waiting requests (3rd in the module documentation): in the policy's order
    /// (`fcfs`: arrival), as
    /// the batching mode, the budget, the batch size and the free blocks allow; a prompt's
    /// cached prefix is shared, not computed. Requests whose adapter cannot join yet are
    /// passed over and keep their place.
    pub(super) fn admit(&mut self, now: Instant, plan: &mut StepPlan) {
        let cap = match self.config.batching {
            Batching::None => 1,
            _ => self.config.max_batch_size,
        };
        let mut passed = Vec::new();
        while plan.budget > 0 && self.running.len() < cap {
            let Some(i) = self.next_waiting(&passed, now) else {
                break;
            };
            if !self.may_admit(i, now, &mut plan.out) {
                break;
            }
            match self.admit_at(i, plan) {
                Admitted::Joined | Admitted::Refused => {}
                Admitted::Passed => passed.push(self.waiting.get(i).expect("passed over").id),
                Admitted::Wait => break,
            }
        }
    }

    /// Whether the batching mode lets waiting request `i` join now; forms a new batch
    /// (dynamic, static) from the front of the queue when the previous one is done.
    fn may_admit(&mut self, i: usize, now: Instant, out: &mut Schedule) -> bool {
        let Some(seq) = self.waiting.get(i) else {
            return false;
        };
        match self.config.batching {
            Batching::Continuous => true,
            Batching::None => self.running.is_empty(),
            Batching::Dynamic | Batching::Static => {
                if seq.in_batch {
                    return true;
                }
                if !self.running.is_empty() {
                    return false;
                }
                let front = self.waiting.front().expect("the queue holds `i`");
                if self.config.batching == Batching::Dynamic
                    && self.waiting.len() < self.config.max_batch_size
                {
                    let due = front.arrived + self.config.batch_timeout;
                    if now < due {
                        out.wake_at = Some(due);
                        return false;
                    }
                }
                let size = self.config.max_batch_size;
                for seq in self.waiting.iter_mut().take(size) {
                    seq.in_batch = true;
                }
                self.waiting.get(i).is_some_and(|s| s.in_batch)
            }
        }
    }

    /// Admits waiting request `i` if it can join now (see `Admitted`).
    fn admit_at(&mut self, i: usize, plan: &mut StepPlan) -> Admitted {
        let seq = self.waiting.get(i).expect("may_admit saw it");
        let id = seq.id;
        let adapter_need = match self.adapter_need(seq) {
            Ok(n) => n,
            Err(why) => return why,
        };
        let adapter_blocks = seq.adapter_blocks.unwrap_or(0);
        if seq.has_adapter()
            && adapter_blocks + self.blocks.blocks_for(seq.final_kv_tokens())
                > self.blocks.num_blocks()
        {
            let seq = self.waiting.remove_at(i).expect("it is there");
            let message = format!(
                "adapter {:?} takes {adapter_blocks} KV blocks and the request's tokens {} more, \
                 but the cache holds {}",
                seq.adapter_id,
                self.blocks.blocks_for(seq.final_kv_tokens()),
                self.blocks.num_blocks()
            );
            self.refuse(seq);
            plan.out.refused.push((id, message));
            return Admitted::Refused;
        }
        if !seq.swapped.is_empty() {
            // Swapped out: its blocks come back from the host, then it goes on.
            let n = self.chunk(seq, plan.budget);
            let need = self.blocks.blocks_for(seq.num_computed + n);
            if need + adapter_need > self.blocks.num_free() {
                return Admitted::Wait;
            }
            let mut seq = self.waiting.remove_at(i).expect("it is there");
            self.use_adapter(&seq, plan);
            let grown = self.blocks.grow_to(id, seq.num_computed + n);
            debug_assert!(grown);
            let table = self.blocks.table(id);
            self.host
                .swap_in(&mut seq.swapped, table, &mut plan.swap_in);
            self.join(seq, n, plan);
            return Admitted::Joined;
        }
        // Fresh, or preempted by recomputation: prefix cache first.
        // Prompt logprobs need every prompt position computed: no prefix reuse then.
        let m = if seq.prompt_logprobs && seq.num_generated() == 0 {
            PrefixMatch::default()
        } else {
            self.blocks
                .match_prefix(&seq.token_ids, chain_seed(&seq.adapter_id))
        };
        if m.pending {
            // The step that just ran is computing this prefix: join next step and share
            // it instead of computing it twice.
            return Admitted::Wait;
        }
        let cached = m.blocks.len() * self.blocks.block_size();
        let n = chunk_len(
            seq.token_ids.len() - cached,
            plan.budget,
            self.config.max_prefill_chunk,
        );
        // The whole chunk must fit: a newcomer squeezed into the last free blocks
        // would only be preempted by the next decode that needs a block.
        let need = self.blocks.blocks_for(cached + n) - m.blocks.len();
        if need + adapter_need > self.blocks.num_free() - self.blocks.unused_in(&m) {
            return Admitted::Wait;
        }
        if self.blocks.caching() {
            plan.out.prefix_queried += seq.token_ids.len();
            plan.out.prefix_hits += cached;
        }
        let mut seq = self.waiting.remove_at(i).expect("it is there");
        // The matched blocks first, so that paging the adapter in cannot evict them.
        self.blocks.adopt_prefix(id, &m);
        self.use_adapter(&seq, plan);
        let grown = self.blocks.grow_to(id, cached + n);
        debug_assert!(grown, "the need was checked");
        seq.num_computed = cached;
        if !seq.started {
            seq.started = true;
            plan.out.admitted.push(id);
        }
        self.join(seq, n, plan);
        Admitted::Joined
    }

    /// Puts an admitted request among the running ones, in arrival order, with its
    /// first `n` tokens planned.
    fn join(&mut self, seq: Sequence, n: usize, plan: &mut StepPlan) {
        let id = seq.id;
        let pos = self.running.partition_point(|s| s.id < id);
        self.running.insert(pos, seq);
        self.plan_tokens(plan, id, n);
    }

    // -- the adapter gate ----------------------------------------------------------------

    /// The adapters waiting requests name whose host load has not finished, each once.
    pub fn adapters_awaited(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .waiting
            .iter()
            .filter(|s| s.awaits_adapter())
            .map(|s| s.adapter_id.clone())
            .collect();
        names.sort_unstable();
        names.dedup();
        names
    }

    /// Adapter `name` is loaded on the shards' hosts and takes `num_blocks` blocks when
    /// paged in: the waiting requests that name it may join.
    pub fn adapter_loaded(&mut self, name: &str, num_blocks: usize) {
        for seq in self.waiting.iter_mut() {
            if seq.adapter_id == name && seq.adapter_blocks.is_none() {
                seq.adapter_blocks = Some(num_blocks);
            }
        }
    }

    /// The waiting requests whose adapter `name` is still to be loaded.
    pub fn waiting_for_adapter(&self, name: &str) -> Vec<RequestId> {
        self.waiting
            .iter()
            .filter(|s| s.adapter_id == name && s.adapter_blocks.is_none())
            .map(|s| s.id)
            .collect()
    }

    /// The adapters being unloaded: each leaves the pool as soon as no running request
    /// uses it (now, for those already idle).
    pub fn set_doomed(&mut self, names: HashSet<String>) {
        for name in &names {
            self.blocks.evict_adapter(name);
        }
        self.doomed = names;
        self.adapters_out.extend(self.blocks.take_evicted());
    }

    /// Blocks waiting request `seq`'s adapter takes from the free count when it joins
    /// (its weights' blocks, unless running requests already use it), or why it cannot
    /// join now.
    fn adapter_need(&self, seq: &Sequence) -> Result<usize, Admitted> {
        if !seq.has_adapter() {
            return Ok(0);
        }
        let Some(num_blocks) = seq.adapter_blocks else {
            return Err(Admitted::Passed); // its host load is not done
        };
        match self.blocks.adapter_users(&seq.adapter_id) {
            Some(users) if users > 0 => Ok(0),
            resident => {
                if self.blocks.active_adapters() >= self.config.max_adapters_per_batch {
                    return Err(Admitted::Passed); // the batch has its share of adapters
                }
                // Resident and idle: its blocks leave the evictable count.
                Ok(resident.map_or(num_blocks, |_| {
                    self.blocks.adapter_blocks(&seq.adapter_id).len()
                }))
            }
        }
    }

    /// A request joins the batch with its adapter: a reference on it when resident, else
    /// it is paged in (its blocks taken, which the admission checked) with this step.
    fn use_adapter(&mut self, seq: &Sequence, plan: &mut StepPlan) {
        if !seq.has_adapter() || self.blocks.acquire_adapter(&seq.adapter_id) {
            return;
        }
        let num_blocks = seq.adapter_blocks.expect("only loaded adapters join");
        let blocks = self
            .blocks
            .page_in(&seq.adapter_id, num_blocks)
            .expect("the need was checked");
        plan.adapters_in.push(pb::AdapterPages {
            name: seq.adapter_id.clone(),
            blocks,
        });
    }

    /// A request left the batch: its reference on its adapter goes, and an adapter being
    /// unloaded leaves the pool with its last user.
    pub(super) fn leave_adapter(&mut self, seq: &Sequence) {
        if !seq.has_adapter() {
            return;
        }
        let users = self.blocks.release_adapter(&seq.adapter_id);
        if users == 0 && self.doomed.contains(&seq.adapter_id) {
            self.blocks.evict_adapter(&seq.adapter_id);
            self.adapters_out.extend(self.blocks.take_evicted());
        }
    }
}
