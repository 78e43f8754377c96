//! The scheduling decision, free of I/O: given the running requests, the waiting queue,
//! the KV blocks and the step budgets, decide what every request computes this step and
//! express it as the `StepRequest` diff the shards apply.
//!
//! As in vLLM V1, a step is `{request: tokens to compute}`: each request's computed count
//! catches up with its known-token count (prompt, then sampled tokens). A prefill chunk
//! and a decode are the same thing; a request samples when it has caught up. Blocks are
//! taken as tokens are computed; nothing is reserved for the output up front.
//!
//! Order of business each step (see docs/scheduler.md):
//! 0. under `--scheduling-policy fair` or `priority`, running requests the policy lets the
//!    first waiting request in line displace when it does not fit (`policy`);
//! 1. running decodes, oldest first, one token each, taking a block when the last one is
//!    full; when none is free the latest-arrived running request is preempted, by
//!    recomputation (blocks dropped, back to the front of the queue with the tokens it
//!    generated) or by swapping (its blocks copied to the host pool, copied back later);
//! 2. running prefills, oldest first: the next chunk, at most `max_prefill_chunk` tokens;
//! 3. waiting requests in the policy's order (fcfs: arrival, preempted ones first; the
//!    victims of 1. and 2. are the policy's too), as the batching mode,
//!    the token budget, the batch size and the free blocks allow; a prompt whose leading
//!    full blocks are in the prefix cache joins with those blocks shared and skips them;
//! 4. the diff: the requests to drop, the block copies and swaps, the requests that join
//!    (with their tokens and block table) and those that go on (with their new blocks).
//!
//! `schedule_ahead` decides the next step while the previous one still runs (the batching
//! loop sends it at once, so the shards go from one step to the next without waiting for
//! the router): the tokens that step samples are *pending* -- known to the shards, not yet
//! to the router -- and count as known tokens, so their requests decode them. Ahead, a
//! request is never preempted, failed or re-joined (a re-join would need the pending token
//! itself): when the running requests are short of blocks nothing is scheduled ahead, and
//! the ordinary schedule, once the step in flight is applied, preempts. A request at its
//! token limit is not scheduled past it.
//!
//! Speculative decoding: a decoding request may carry a `Proposal` (tokens the router's
//! n-gram lookup found, or a number of tokens for the shard's draft model to propose). Once
//! everything else is planned, proposals are added to the planned decodes, oldest first,
//! while the step stays within `speculative_max_step_tokens` (past it, verifying costs more
//! than it is likely to gain), the token budget and the free blocks allow, and never past a
//! request's token limit. The request computes 1 + k tokens; only the first (its sampled
//! token) counts as computed until the answer says how many proposals were accepted
//! (`verified`), and only verified tokens enter the prefix cache. The blocks the rejected
//! proposals took are released then; the shards cut the table the same way.
//!
//! LoRA adapters (unified paging, `blocks::adapters`): a waiting request whose adapter's
//! host load has not finished (`Sequence::adapter_blocks` is None) is skipped, keeping its
//! place, and so is one whose adapter would be one more than `max_adapters_per_batch` in
//! the running batch. Admitting a request whose adapter is not resident takes the
//! adapter's blocks as well as its KV blocks (both must fit, or it waits as any request
//! short of blocks does; admission never preempts) and pages the adapter in with the
//! step's `adapters_in`. A running request holds a reference on its adapter, released
//! when it leaves the batch (finished, failed, preempted by recomputation or by swapping);
//! an adapter nobody uses stays resident until eviction by last use, or until the
//! adapter is being unloaded (`set_doomed`), and leaves with `adapters_out`. A request
//! whose adapter and KV cannot fit even in an empty pool is refused (`Schedule::refused`).
//!
//! This file holds the types and the order of the phases (`schedule_at`, `schedule_ahead`);
//! each phase has its own file: `sequence` and `queue` (the requests, running and
//! waiting), `admission` (with the adapter gate), `beam` (beam search's park, fork and
//! requeue), `step` (decodes, prefill chunks, the
//! diff), `release` (finish, failure, preemption), `host_pool` (swap space), `proposals`
//! (speculation), `policy` (the scheduling policy's order and victims, with `vtc`, the
//! tenants' virtual token counters, and `priority`, aging) and `invariants`.

mod admission;
mod beam;
mod host_pool;
mod invariants;
pub mod objectives;
mod policy;
mod priority;
mod proposals;
mod queue;
mod release;
mod sequence;
mod step;
mod vtc;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use crate::blocks::{chain_seed, BlockManager, RequestId};
use crate::pb;

use host_pool::HostPool;
pub use policy::SchedulingPolicy;
pub use queue::Queue;
pub use sequence::{Proposal, Sequence};
pub use vtc::VirtualCounters;
use vtc::VirtualCounters as Counters;

/// What happens to a request's KV when the cache runs out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preemption {
    /// Drop the blocks; recompute prompt + generated tokens when it resumes.
    Recompute,
    /// Copy the blocks to the shards' host pool and back (recompute when the pool is full).
    Swap,
}

/// When waiting requests may join.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Batching {
    /// At any step, into the running batch.
    Continuous,
    /// A batch forms once `max_batch_size` requests wait or the oldest has waited
    /// `batch_timeout`; nothing joins it until its last member finishes.
    Dynamic,
    /// A batch forms from whatever waits when the previous one is done; nothing joins it
    /// until its longest member finishes.
    Static,
    /// One request at a time.
    None,
}

#[derive(Debug, Clone, Copy)]
pub struct SchedulerConfig {
    pub max_batch_tokens: usize,
    pub max_batch_size: usize,
    pub num_blocks: usize,
    pub block_size: usize,
    /// Most prompt tokens one request computes per step; 0 = the token budget.
    pub max_prefill_chunk: usize,
    pub preemption: Preemption,
    /// Host blocks available for swapping.
    pub swap_blocks: usize,
    pub prefix_caching: bool,
    pub batching: Batching,
    pub batch_timeout: Duration,
    /// Speculative decoding: proposals are added to a step only while it holds at most this
    /// many tokens (0: no speculation).
    pub speculative_max_step_tokens: usize,
    /// Most distinct LoRA adapters among the running requests.
    pub max_adapters_per_batch: usize,
    /// Who joins first and who is preempted (`policy`).
    pub policy: SchedulingPolicy,
}

impl SchedulerConfig {
    /// Continuous batching, recompute preemption, prefix caching on, no chunk limit.
    pub fn new(
        max_batch_tokens: usize,
        max_batch_size: usize,
        num_blocks: usize,
        block_size: usize,
    ) -> Self {
        Self {
            max_batch_tokens,
            max_batch_size,
            num_blocks,
            block_size,
            max_prefill_chunk: 0,
            preemption: Preemption::Recompute,
            swap_blocks: 0,
            prefix_caching: true,
            batching: Batching::Continuous,
            batch_timeout: Duration::from_millis(50),
            speculative_max_step_tokens: 0,
            max_adapters_per_batch: 32,
            policy: SchedulingPolicy::Fcfs,
        }
    }
}

/// What `Scheduler::schedule` decided.
#[derive(Debug, Default)]
pub struct Schedule {
    /// The diff to send to every shard; `None` when nothing runs this step.
    pub step: Option<pb::StepRequest>,
    /// Requests that will have computed all their known tokens after this step, so the
    /// shards answer with a sampled token for each.
    pub samples: Vec<RequestId>,
    /// Requests dropped because they cannot fit in the KV cache even alone.
    pub failed: Vec<RequestId>,
    /// Requests dropped at admission, and why: with their adapter's weights they could not
    /// fit in the KV cache even alone.
    pub refused: Vec<(RequestId, String)>,
    /// Requests preempted by recomputation this step (already back in the queue).
    pub preempted: Vec<RequestId>,
    /// Requests preempted by swapping this step (already back in the queue).
    pub swapped_out: Vec<RequestId>,
    /// How many of those preemptions the scheduling policy made so that a waiting
    /// request could join (`policy`), rather than for lack of blocks.
    pub displaced: usize,
    /// Requests that left the queue for the first time.
    pub admitted: Vec<RequestId>,
    /// Tokens computed by this step.
    pub num_tokens: usize,
    /// Prompt tokens looked up in the prefix cache, and how many were found.
    pub prefix_queried: usize,
    pub prefix_hits: usize,
    /// Nothing may run before then (a dynamic batch waiting for its timeout).
    pub wake_at: Option<Instant>,
    /// Requests whose proposals go into this step (speculative decoding), and how many
    /// proposed tokens they carry in all.
    pub speculating: usize,
    pub proposed_tokens: usize,
    /// Requests with a proposal left without it because the step was past
    /// `speculative_max_step_tokens` (the load switch).
    pub speculation_off: usize,
}

#[derive(Debug)]
pub struct Scheduler {
    config: SchedulerConfig,
    waiting: Queue,
    /// Sorted by id (arrival order).
    running: Vec<Sequence>,
    blocks: BlockManager,
    /// Ids whose shard state must be dropped at the next step.
    removed: Vec<RequestId>,
    /// Host blocks for preemption by swapping.
    host: HostPool,
    step_id: u64,
    /// Adapters evicted and not yet sent in a step's `adapters_out`.
    adapters_out: Vec<String>,
    /// Adapters being unloaded: evicted as soon as no running request uses them.
    doomed: HashSet<String>,
    /// The tenants' virtual counters (`fair`).
    counters: Counters,
}

impl Scheduler {
    pub fn new(config: SchedulerConfig) -> Self {
        let swap = match config.preemption {
            Preemption::Swap => config.swap_blocks as u32,
            Preemption::Recompute => 0,
        };
        Self {
            blocks: BlockManager::new(config.num_blocks, config.block_size, config.prefix_caching),
            config,
            waiting: Queue::default(),
            running: Vec::new(),
            removed: Vec::new(),
            host: HostPool::new(swap),
            step_id: 0,
            adapters_out: Vec::new(),
            doomed: HashSet::new(),
            counters: Counters::default(),
        }
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// Queues a new request behind every other.
    pub fn add(&mut self, seq: Sequence) {
        self.waiting.push_back(seq);
    }

    /// Requests to run, or adapters whose eviction the shards have yet to learn.
    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty() || !self.adapters_out.is_empty()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Host blocks not holding a swapped-out request.
    pub fn num_host_free(&self) -> usize {
        self.host.num_unused()
    }

    pub fn blocks(&self) -> &BlockManager {
        &self.blocks
    }

    pub fn running(&self) -> &[Sequence] {
        &self.running
    }

    pub fn waiting(&self) -> &Queue {
        &self.waiting
    }

    /// Tokens whose KV the running requests hold ÷ the slots of the blocks they hold.
    pub fn kv_utilization(&self) -> f64 {
        let bs = self.blocks.block_size();
        let (mut stored, mut slots) = (0usize, 0usize);
        for seq in &self.running {
            stored += seq.num_computed;
            slots += self.blocks.table(seq.id).len() * bs;
        }
        if slots == 0 {
            0.0
        } else {
            stored as f64 / slots as f64
        }
    }

    fn running_index(&self, id: RequestId) -> Option<usize> {
        self.running.binary_search_by_key(&id, |s| s.id).ok()
    }

    /// A running or waiting request.
    pub fn get(&self, id: RequestId) -> Option<&Sequence> {
        match self.running_index(id) {
            Some(i) => Some(&self.running[i]),
            None => self.waiting.iter().find(|s| s.id == id),
        }
    }

    /// Appends sampled tokens to a running request (they were pending when the step after
    /// theirs was scheduled ahead; the full blocks they complete enter the prefix cache).
    pub fn append_tokens(&mut self, id: RequestId, tokens: &[u32]) -> bool {
        match self.running_index(id) {
            Some(i) => {
                let seq = &mut self.running[i];
                seq.token_ids.extend_from_slice(tokens);
                seq.pending = seq.pending.saturating_sub(tokens.len());
                let seed = chain_seed(&seq.adapter_id);
                self.blocks
                    .register_full(id, &seq.token_ids, seq.num_computed, seed);
                true
            }
            None => false,
        }
    }

    /// Appends tokens a grammar forced after the request's last sampled token: known
    /// without sampling, computed by its next step as a short chunk (the shards learn
    /// them with it). Needs nothing pending: a step scheduled ahead would not carry them.
    pub fn append_forced(&mut self, id: RequestId, tokens: &[u32]) -> bool {
        match self.running_index(id) {
            Some(i) if self.running[i].pending == 0 => {
                let seq = &mut self.running[i];
                seq.token_ids.extend_from_slice(tokens);
                seq.forced_unsent += tokens.len();
                true
            }
            _ => false,
        }
    }

    /// The step just sent samples a token for each of `ids`: until `append_tokens` brings
    /// it, `schedule_ahead` counts it as pending.
    pub fn expect_samples(&mut self, ids: &[RequestId]) {
        for &id in ids {
            if let Some(i) = self.running_index(id) {
                self.running[i].pending += 1;
            }
        }
    }

    /// A parallel sample of running request `parent` with id `child` (greater than every
    /// id so far): it shares every block of the parent and joins at the next step; the
    /// first write into a shared partial block copies it. A child forked from a parent
    /// that has caught up (it just sampled, the token not yet appended) recomputes the
    /// last known token, into a copy of its block, to sample its own with its own seed.
    pub fn fork(&mut self, parent: RequestId, child: RequestId, seed: u64) -> bool {
        self.fork_running(parent, child, |seq| {
            seq.sampling.seed = seed;
            // The parent's sample (pending until applied) is its own, not the child's.
            seq.pending = 0;
            if seq.remaining() == 0 {
                seq.num_computed -= 1;
            }
        })
    }

    /// Running request `parent` copied as `child` (an id greater than every other), shaped
    /// by `shape`, sharing every block of the parent (and its adapter), to join the shards
    /// at the next step; false when the parent is not running or the batch is full. What
    /// parallel samples and beams have in common.
    fn fork_running(
        &mut self,
        parent: RequestId,
        child: RequestId,
        shape: impl FnOnce(&mut Sequence),
    ) -> bool {
        let Some(i) = self.running_index(parent) else {
            return false;
        };
        if self.running.last().is_some_and(|s| s.id >= child)
            || self.running.len() >= self.config.max_batch_size
        {
            return false;
        }
        let mut seq = self.running[i].clone();
        seq.id = child;
        seq.on_shard = false;
        seq.blocks_sent = 0;
        seq.prompt_logprobs = false;
        seq.proposal = Proposal::None;
        shape(&mut seq);
        self.blocks.fork(parent, child);
        if seq.has_adapter() {
            let resident = self.blocks.acquire_adapter(&seq.adapter_id);
            debug_assert!(resident, "a running parent's adapter is resident");
        }
        self.running.push(seq);
        true
    }

    /// Forgets every request, block and cached prefix (after a shard failure; the shards
    /// are cleared separately). Returns the ids that were in flight.
    pub fn reset(&mut self) -> Vec<RequestId> {
        let mut seqs: Vec<Sequence> = self.running.drain(..).collect();
        seqs.extend(self.waiting.drain());
        let mut ids = Vec::with_capacity(seqs.len());
        for mut seq in seqs {
            self.blocks.free(seq.id);
            self.host.give_back(&mut seq.swapped);
            ids.push(seq.id);
        }
        self.host.step_ran();
        self.blocks.clear_cache();
        // A new session starts with no adapter paged in on the shards.
        self.blocks.clear_adapters();
        self.adapters_out.clear();
        self.removed.clear();
        ids
    }

    /// Decides the next step now. See the module documentation for the policy.
    pub fn schedule(&mut self) -> Schedule {
        self.schedule_at(Instant::now())
    }

    /// Decides the next step as of `now` (dynamic batching compares arrival times to it).
    pub fn schedule_at(&mut self, now: Instant) -> Schedule {
        self.observe_backlog();
        let mut plan = self.begin_step();
        // 0. The policy's displacements: running requests preempted for the first in line.
        self.displace(now, &mut plan);
        plan.out.displaced = plan.out.preempted.len() + plan.out.swapped_out.len();
        // 1. Running decodes; the policy's victim (fcfs: the latest arrival) is preempted
        //    when blocks run out, and the decode that was short of them retries.
        let mut from = 0;
        while let Some(i) = self.plan_decodes(&mut plan, from) {
            self.preempt_latest(i, &mut plan, now);
            from = i;
        }
        // 2. Running prefills; a chunk without a block preempts or waits.
        let mut from = 0;
        while let Some(i) = self.plan_prefills(&mut plan, from) {
            from = self.make_room_for_prefill(i, &mut plan, now);
        }
        // 3. Waiting requests, unless this step had to preempt (they would thrash).
        if !plan.preempted() {
            self.admit(now, &mut plan);
        }
        // 4. Proposals onto the planned decodes, while the step stays small.
        self.add_proposals(&mut plan);
        self.build_step(plan)
    }

    /// Decides the next step while the previous one runs: see the module documentation.
    /// Nothing (an empty schedule) when the running requests are short of blocks: the
    /// ordinary schedule, once the step in flight is applied, preempts as it should.
    pub fn schedule_ahead(&mut self) -> Schedule {
        let now = Instant::now();
        self.observe_backlog();
        if self.short_of_blocks() || self.displacement_due(now) {
            return Schedule::default();
        }
        let mut plan = self.begin_step();
        // Proposals follow the last token, which is pending here: none ahead.
        for seq in &mut self.running {
            seq.proposal = Proposal::None;
        }
        // 1. and 2. as `schedule_at`, except that nothing is preempted ahead: a request
        //    short of blocks waits for the next step.
        let mut starved = false;
        let mut from = 0;
        while let Some(i) = self.plan_decodes(&mut plan, from) {
            starved = true;
            from = i + 1;
        }
        let mut from = 0;
        while let Some(i) = self.plan_prefills(&mut plan, from) {
            starved = true;
            from = i + 1;
        }
        // 3. Waiting requests, unless a running request was left waiting for blocks.
        if !starved {
            self.admit(now, &mut plan);
        }
        self.build_step(plan)
    }
}

#[cfg(test)]
mod tests;
