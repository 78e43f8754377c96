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
//! 1. running decodes, oldest first, one token each, taking a block when the last one is
//!    full; when none is free the latest-arrived running request is preempted, by
//!    recomputation (blocks dropped, back to the front of the queue with the tokens it
//!    generated) or by swapping (its blocks copied to the host pool, copied back later);
//! 2. running prefills, oldest first: the next chunk, at most `max_prefill_chunk` tokens;
//! 3. waiting requests in arrival order (preempted ones first), as the batching mode,
//!    the token budget, the batch size and the free blocks allow; a prompt whose leading
//!    full blocks are in the prefix cache joins with those blocks shared and skips them.

use std::time::{Duration, Instant};

use crate::blocks::{chain_seed, BlockManager, PrefixMatch, RequestId};
use crate::pb;
use crate::queue::Queue;

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

/// The scheduler's view of one request.
#[derive(Debug, Clone)]
pub struct Sequence {
    /// Assigned in arrival order, so a smaller id arrived earlier.
    pub id: RequestId,
    /// Every known token: the prompt, then the generated ones.
    pub token_ids: Vec<u32>,
    pub prompt_len: usize,
    /// Leading tokens whose KV is in this request's blocks (or its swapped-out copy).
    pub num_computed: usize,
    /// Whether the shards hold state for this request (it joined and was not removed).
    pub on_shard: bool,
    /// Blocks of its table the shards already know.
    pub blocks_sent: usize,
    pub sampling: pb::SamplingParams,
    pub top_n_tokens: u32,
    pub adapter_id: String,
    pub num_preemptions: u32,
    /// The shards return the prompt tokens' logprobs with the first sampled token.
    pub prompt_logprobs: bool,
    pub arrived: Instant,
    /// Host blocks holding its KV while swapped out, in table order.
    pub swapped: Vec<u32>,
    /// Whether it has ever been admitted (left the queue for the first time).
    pub started: bool,
    /// Member of the batch being formed or run (dynamic and static batching).
    in_batch: bool,
}

impl Sequence {
    pub fn new(id: RequestId, prompt: Vec<u32>, sampling: pb::SamplingParams) -> Self {
        Self {
            id,
            prompt_len: prompt.len(),
            token_ids: prompt,
            num_computed: 0,
            on_shard: false,
            blocks_sent: 0,
            sampling,
            top_n_tokens: 0,
            adapter_id: String::new(),
            num_preemptions: 0,
            prompt_logprobs: false,
            arrived: Instant::now(),
            swapped: Vec::new(),
            started: false,
            in_batch: false,
        }
    }

    pub fn num_generated(&self) -> usize {
        self.token_ids.len() - self.prompt_len
    }

    fn remaining(&self) -> usize {
        self.token_ids.len() - self.num_computed
    }
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
    /// Requests preempted by recomputation this step (already back in the queue).
    pub preempted: Vec<RequestId>,
    /// Requests preempted by swapping this step (already back in the queue).
    pub swapped_out: Vec<RequestId>,
    /// Requests that left the queue for the first time.
    pub admitted: Vec<RequestId>,
    /// Tokens computed by this step.
    pub num_tokens: usize,
    /// Prompt tokens looked up in the prefix cache, and how many were found.
    pub prefix_queried: usize,
    pub prefix_hits: usize,
    /// Nothing may run before then (a dynamic batch waiting for its timeout).
    pub wake_at: Option<Instant>,
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
    /// Free host block ids; the next one handed out is at the end.
    host_free: Vec<u32>,
    /// Host blocks read by this step's swap-ins: free once it has run.
    host_released: Vec<u32>,
    step_id: u64,
}

/// One request's share of the step being built.
struct Planned {
    id: RequestId,
    n: usize,
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
            host_free: (0..swap).rev().collect(),
            host_released: Vec::new(),
            step_id: 0,
        }
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// Queues a new request behind every other.
    pub fn add(&mut self, seq: Sequence) {
        self.waiting.push_back(seq);
    }

    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Host blocks not holding a swapped-out request.
    pub fn num_host_free(&self) -> usize {
        self.host_free.len() + self.host_released.len()
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

    /// Appends sampled tokens to a running request.
    pub fn append_tokens(&mut self, id: RequestId, tokens: &[u32]) -> bool {
        match self.running_index(id) {
            Some(i) => {
                self.running[i].token_ids.extend_from_slice(tokens);
                true
            }
            None => false,
        }
    }

    /// A parallel sample of running request `parent` with id `child` (greater than every
    /// id so far): it shares every block of the parent and joins at the next step; the
    /// first write into a shared partial block copies it. A child forked from a parent
    /// that has caught up (it just sampled, the token not yet appended) recomputes the
    /// last known token, into a copy of its block, to sample its own with its own seed.
    pub fn fork(&mut self, parent: RequestId, child: RequestId, seed: u64) -> bool {
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
        seq.sampling.seed = seed;
        seq.prompt_logprobs = false;
        if seq.remaining() == 0 {
            seq.num_computed -= 1;
        }
        self.blocks.fork(parent, child);
        self.running.push(seq);
        true
    }

    /// Retires a request (finished, cancelled or failed): frees its blocks now and tells
    /// the shards to drop its state at the next step.
    pub fn finish(&mut self, id: RequestId) -> Option<Sequence> {
        let mut seq = match self.running_index(id) {
            Some(i) => self.running.remove(i),
            None => self.waiting.remove(id)?,
        };
        self.blocks.free(id);
        self.host_free.append(&mut seq.swapped);
        if seq.on_shard {
            self.removed.push(id);
        }
        Some(seq)
    }

    /// Forgets every request, block and cached prefix (after a shard failure; the shards
    /// are cleared separately). Returns the ids that were in flight.
    pub fn reset(&mut self) -> Vec<RequestId> {
        let mut seqs: Vec<Sequence> = self.running.drain(..).collect();
        seqs.extend(self.waiting.drain());
        let mut ids = Vec::with_capacity(seqs.len());
        for mut seq in seqs {
            self.blocks.free(seq.id);
            self.host_free.append(&mut seq.swapped);
            ids.push(seq.id);
        }
        self.host_free.append(&mut self.host_released);
        self.blocks.clear_cache();
        self.removed.clear();
        ids
    }

    /// Preempts `seq` (already out of `running`): by swapping when asked and the host
    /// pool has room, else by recomputation. Returns whether it was swapped.
    fn preempt(&mut self, mut seq: Sequence, swap_out: &mut Vec<pb::BlockCopy>) -> bool {
        let table = self.blocks.table(seq.id);
        let swap = self.config.preemption == Preemption::Swap
            && seq.on_shard
            && !table.is_empty()
            && table.len() <= self.host_free.len();
        if swap {
            for &src in table {
                let dst = self.host_free.pop().expect("checked above");
                swap_out.push(pb::BlockCopy { src, dst });
                seq.swapped.push(dst);
            }
        } else {
            seq.num_computed = 0;
        }
        self.blocks.free(seq.id);
        if seq.on_shard {
            self.removed.push(seq.id);
        }
        seq.on_shard = false;
        seq.blocks_sent = 0;
        seq.num_preemptions += 1;
        self.waiting.push_front(seq);
        swap
    }

    /// Most tokens `seq` can compute from its current position with the free blocks.
    fn fits(&self, seq: &Sequence) -> usize {
        let capacity =
            (self.blocks.table(seq.id).len() + self.blocks.num_free()) * self.blocks.block_size();
        capacity.saturating_sub(seq.num_computed)
    }

    /// Tokens of `seq`'s next chunk within `budget`.
    fn chunk(&self, seq: &Sequence, budget: usize) -> usize {
        let mut n = seq.remaining().min(budget);
        if seq.remaining() > 1 && self.config.max_prefill_chunk > 0 {
            n = n.min(self.config.max_prefill_chunk);
        }
        n
    }

    /// Takes the blocks (and copy-on-write copies) running request `i` needs to compute
    /// `n` more tokens. All or nothing.
    fn take_blocks(&mut self, i: usize, n: usize, copies: &mut Vec<pb::BlockCopy>) -> bool {
        let (id, from) = (self.running[i].id, self.running[i].num_computed);
        let need =
            self.blocks.copies_needed(id, from, from + n) + self.blocks.missing_for(id, from + n);
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

    /// Adds `n` tokens of running request `id` to the step, and enters the full blocks
    /// they complete in the prefix cache (hit-able once the step has run).
    fn plan_tokens(&mut self, plan: &mut Vec<Planned>, id: RequestId, n: usize) {
        plan.push(Planned { id, n });
        let i = self
            .running_index(id)
            .expect("planned requests are running");
        let seq = &self.running[i];
        let seed = chain_seed(&seq.adapter_id);
        self.blocks
            .register_full(id, &seq.token_ids, seq.num_computed + n, seed);
    }

    /// Decides the next step now. See the module documentation for the policy.
    pub fn schedule(&mut self) -> Schedule {
        self.schedule_at(Instant::now())
    }

    /// Decides the next step as of `now` (dynamic batching compares arrival times to it).
    pub fn schedule_at(&mut self, now: Instant) -> Schedule {
        // The previous step has run: its blocks are hit-able, its swapped-in host blocks free.
        self.blocks.mark_ready();
        self.host_free.append(&mut self.host_released);

        let mut out = Schedule::default();
        let mut budget = self.config.max_batch_tokens;
        let mut plan: Vec<Planned> = Vec::new();
        let mut copies = Vec::new();
        let mut swap_out = Vec::new();
        let mut swap_in = Vec::new();

        // 1. Running decodes, oldest first; preempt the latest arrival when blocks run out.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            if self.running[i].remaining() != 1 {
                i += 1;
                continue;
            }
            if self.take_blocks(i, 1, &mut copies) {
                self.plan_tokens(&mut plan, self.running[i].id, 1);
                budget -= 1;
                i += 1;
                continue;
            }
            let id = self.running[i].id;
            let victim = self.running.pop().expect("running is not empty");
            if victim.id == id && self.running.is_empty() {
                // It cannot fit even with the whole cache to itself.
                self.drop_failed(victim);
                out.failed.push(id);
            } else {
                let vid = victim.id;
                if self.preempt(victim, &mut swap_out) {
                    out.swapped_out.push(vid);
                } else {
                    out.preempted.push(vid);
                }
            }
            // Retry the same request (now with more blocks free), unless it was the victim.
        }

        // 2. Running prefills (chunked), oldest first.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let seq = &self.running[i];
            let id = seq.id;
            if seq.remaining() <= 1 {
                i += 1;
                continue;
            }
            let mut n = self.chunk(seq, budget);
            let fits = self.fits(seq);
            if fits > 0 && fits < n {
                n = fits; // a chunk shrinks to the free blocks rather than preempting
            }
            if fits > 0 && self.take_blocks(i, n, &mut copies) {
                self.plan_tokens(&mut plan, id, n);
                budget -= n;
                i += 1;
                continue;
            }
            // Not even one block: preempt a later arrival that has nothing planned, or
            // wait for decodes to finish (they preempt when they need to).
            let victim = self
                .running
                .iter()
                .rposition(|s| s.id > id && !plan.iter().any(|p| p.id == s.id));
            match victim {
                Some(v) => {
                    let victim = self.running.remove(v);
                    let vid = victim.id;
                    if self.preempt(victim, &mut swap_out) {
                        out.swapped_out.push(vid);
                    } else {
                        out.preempted.push(vid);
                    }
                }
                None if self.running.len() == 1 => {
                    let seq = self.running.remove(i);
                    self.drop_failed(seq);
                    out.failed.push(id);
                }
                None => i += 1,
            }
        }

        // 3. Waiting requests, unless this step had to preempt (they would thrash).
        let preempted = !out.preempted.is_empty() || !out.swapped_out.is_empty();
        if !preempted {
            self.admit(now, &mut budget, &mut plan, &mut swap_in, &mut out);
        }

        let removed = std::mem::take(&mut self.removed);
        if plan.is_empty() && swap_out.is_empty() {
            // Keep the removals for the next real step.
            self.removed = removed;
            return out;
        }

        // 4. The diff; full blocks computed by it enter the prefix cache.
        let mut step = pb::StepRequest {
            step_id: self.step_id,
            removed,
            copies,
            swap_out,
            swap_in,
            ..Default::default()
        };
        self.step_id += 1;
        for Planned { id, n } in plan {
            let i = self
                .running_index(id)
                .expect("planned requests are running");
            let table = self.blocks.table(id);
            let seq = &mut self.running[i];
            if seq.on_shard {
                step.continuing.push(pb::ContinuingRequest {
                    id,
                    num_compute: n as u32,
                    new_blocks: table[seq.blocks_sent..].to_vec(),
                });
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
                });
                seq.on_shard = true;
            }
            seq.blocks_sent = table.len();
            seq.num_computed += n;
            out.num_tokens += n;
            if seq.num_computed == seq.token_ids.len() {
                out.samples.push(id);
            }
        }
        out.step = Some(step);
        out
    }

    fn drop_failed(&mut self, mut seq: Sequence) {
        self.blocks.free(seq.id);
        self.host_free.append(&mut seq.swapped);
        if seq.on_shard {
            self.removed.push(seq.id);
        }
    }

    /// Whether the batching mode lets the queue's front join now; forms a new batch
    /// (dynamic, static) when the previous one is done.
    fn may_admit(&mut self, now: Instant, out: &mut Schedule) -> bool {
        let Some(front) = self.waiting.front() else {
            return false;
        };
        match self.config.batching {
            Batching::Continuous => true,
            Batching::None => self.running.is_empty(),
            Batching::Dynamic | Batching::Static => {
                if front.in_batch {
                    return true;
                }
                if !self.running.is_empty() {
                    return false;
                }
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
                true
            }
        }
    }

    fn admit(
        &mut self,
        now: Instant,
        budget: &mut usize,
        plan: &mut Vec<Planned>,
        swap_in: &mut Vec<pb::BlockCopy>,
        out: &mut Schedule,
    ) {
        let cap = match self.config.batching {
            Batching::None => 1,
            _ => self.config.max_batch_size,
        };
        while *budget > 0 && self.running.len() < cap && self.may_admit(now, out) {
            let seq = self.waiting.front().expect("may_admit saw it");
            let id = seq.id;
            if !seq.swapped.is_empty() {
                // Swapped out: its blocks come back from the host, then it goes on.
                let n = self.chunk(seq, *budget);
                let need = self.blocks.blocks_for(seq.num_computed + n);
                if need > self.blocks.num_free() {
                    break;
                }
                let mut seq = self.waiting.pop_front().expect("front exists");
                let grown = self.blocks.grow_to(id, seq.num_computed + n);
                debug_assert!(grown);
                let table = self.blocks.table(id);
                for (&src, &dst) in seq.swapped.iter().zip(table) {
                    swap_in.push(pb::BlockCopy { src, dst });
                }
                self.host_released.append(&mut seq.swapped);
                self.join(seq, n, budget, plan);
                continue;
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
                break;
            }
            let cached = m.blocks.len() * self.blocks.block_size();
            let n = (seq.token_ids.len() - cached).min(*budget);
            let n = match self.config.max_prefill_chunk {
                0 => n,
                c if seq.token_ids.len() - cached > 1 => n.min(c),
                _ => n,
            };
            // The whole chunk must fit: a newcomer squeezed into the last free blocks
            // would only be preempted by the next decode that needs a block.
            let need = self.blocks.blocks_for(cached + n) - m.blocks.len();
            if need > self.blocks.num_free() - self.blocks.unused_in(&m) {
                break;
            }
            if self.blocks.caching() {
                out.prefix_queried += seq.token_ids.len();
                out.prefix_hits += cached;
            }
            let mut seq = self.waiting.pop_front().expect("front exists");
            self.blocks.adopt_prefix(id, &m);
            let grown = self.blocks.grow_to(id, cached + n);
            debug_assert!(grown, "the need was checked");
            seq.num_computed = cached;
            if !seq.started {
                seq.started = true;
                out.admitted.push(id);
            }
            self.join(seq, n, budget, plan);
        }
    }

    fn join(&mut self, seq: Sequence, n: usize, budget: &mut usize, plan: &mut Vec<Planned>) {
        let id = seq.id;
        let pos = self.running.partition_point(|s| s.id < id);
        self.running.insert(pos, seq);
        self.plan_tokens(plan, id, n);
        *budget -= n;
    }

    /// Checks the bookkeeping (tests and debug builds).
    pub fn check_invariants(&self) -> Result<(), String> {
        self.blocks.check_invariants()?;
        if !self.running.windows(2).all(|w| w[0].id < w[1].id) {
            return Err("running is not sorted by arrival".into());
        }
        if self.running.len() > self.config.max_batch_size {
            return Err("running exceeds max_batch_size".into());
        }
        let bs = self.blocks.block_size();
        for seq in &self.running {
            let held = self.blocks.table(seq.id).len();
            if held * bs < seq.num_computed || held > self.blocks.blocks_for(seq.num_computed) {
                return Err(format!(
                    "request {} computed {} tokens in {held} blocks",
                    seq.id, seq.num_computed
                ));
            }
            if !seq.swapped.is_empty() {
                return Err(format!("running request {} is swapped out", seq.id));
            }
        }
        let mut host = self.host_free.clone();
        host.extend(&self.host_released);
        for seq in self.waiting.iter() {
            if self.blocks.holds(seq.id) || seq.on_shard {
                return Err(format!("waiting request {} holds resources", seq.id));
            }
            if seq.swapped.is_empty() != (seq.num_computed == 0) {
                return Err(format!(
                    "waiting request {}: {} computed tokens, {} host blocks",
                    seq.id,
                    seq.num_computed,
                    seq.swapped.len()
                ));
            }
            host.extend(&seq.swapped);
        }
        let want = match self.config.preemption {
            Preemption::Swap => self.config.swap_blocks,
            Preemption::Recompute => 0,
        };
        host.sort_unstable();
        host.dedup();
        if host.len() != want || host.last().is_some_and(|&h| h as usize >= want) {
            return Err(format!(
                "host blocks leaked: {} of {want} accounted",
                host.len()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn config(
        max_batch_tokens: usize,
        max_batch_size: usize,
        num_blocks: usize,
    ) -> SchedulerConfig {
        let mut c = SchedulerConfig::new(max_batch_tokens, max_batch_size, num_blocks, 4);
        c.prefix_caching = false; // these prompts all start alike
        c
    }

    fn seq(id: u64, prompt_len: usize) -> Sequence {
        Sequence::new(
            id,
            (0..prompt_len as u32).map(|t| t + 100).collect(),
            Default::default(),
        )
    }

    /// Plays the shard: every request that samples gets token `1000 + id`.
    fn step(s: &mut Scheduler) -> Schedule {
        let out = s.schedule();
        for &id in &out.samples {
            assert!(s.append_tokens(id, &[1000 + id as u32]));
        }
        s.check_invariants().unwrap();
        out
    }

    fn step_at(s: &mut Scheduler, now: Instant) -> Schedule {
        let out = s.schedule_at(now);
        for &id in &out.samples {
            assert!(s.append_tokens(id, &[1000 + id as u32]));
        }
        s.check_invariants().unwrap();
        out
    }

    fn computes(out: &Schedule) -> Vec<(u64, u32)> {
        let step = out.step.as_ref().unwrap();
        let mut v: Vec<(u64, u32)> = step.joined.iter().map(|r| (r.id, r.num_compute)).collect();
        v.extend(step.continuing.iter().map(|r| (r.id, r.num_compute)));
        v
    }

    #[test]
    fn budgets_cap_tokens_and_batch_size() {
        let mut s = Scheduler::new(config(10, 3, 100));
        for id in 0..5 {
            s.add(seq(id, 3));
        }
        let out = step(&mut s);
        assert_eq!(computes(&out), vec![(0, 3), (1, 3), (2, 3)]);
        assert_eq!(out.num_tokens, 9);
        assert_eq!(s.num_waiting(), 2);
        let out = step(&mut s);
        // Three decodes; the batch is full so nobody joins.
        assert_eq!(computes(&out), vec![(0, 1), (1, 1), (2, 1)]);
    }

    #[test]
    fn decodes_run_before_new_admissions_and_long_prompts_are_chunked() {
        let mut s = Scheduler::new(config(8, 8, 100));
        s.add(seq(0, 2));
        s.add(seq(1, 2));
        step(&mut s);
        s.add(seq(2, 20));
        let out = step(&mut s);
        let step_req = out.step.as_ref().unwrap();
        assert_eq!(
            step_req
                .continuing
                .iter()
                .map(|r| (r.id, r.num_compute))
                .collect::<Vec<_>>(),
            vec![(0, 1), (1, 1)]
        );
        assert_eq!(step_req.joined.len(), 1);
        let joined = &step_req.joined[0];
        assert_eq!(
            (joined.id, joined.num_compute, joined.num_cached),
            (2, 6, 0)
        );
        assert_eq!(joined.token_ids.len(), 20);
        assert_eq!(joined.block_table.len(), 2); // 6 tokens, blocks of 4
        assert_eq!(out.samples, vec![0, 1]); // the chunked prefill does not sample yet
                                             // The rest of the prompt arrives in later chunks with the new blocks only.
        let out = step(&mut s);
        let c = out
            .step
            .as_ref()
            .unwrap()
            .continuing
            .iter()
            .find(|r| r.id == 2)
            .unwrap()
            .clone();
        assert_eq!(c.num_compute, 6);
        assert_eq!(c.new_blocks.len(), 1); // 12 tokens: 3 blocks
        let out = step(&mut s);
        assert!(!out.samples.contains(&2));
        let out = step(&mut s);
        assert_eq!(computes(&out), vec![(0, 1), (1, 1), (2, 2)]);
        assert!(out.samples.contains(&2));
        assert_eq!(s.get(2).unwrap().num_generated(), 1);
    }

    #[test]
    fn preemption_takes_the_latest_arrival_and_rejoin_carries_generated_tokens() {
        // 4 blocks of 4 tokens: two requests of 4-token prompts fill 2 blocks, then each
        // needs a new block every 4 decodes.
        let mut s = Scheduler::new(config(64, 8, 4));
        s.add(seq(0, 4));
        s.add(seq(1, 4));
        let mut preempted_at = None;
        for n in 0..12 {
            let out = step(&mut s);
            if !out.preempted.is_empty() {
                assert_eq!(out.preempted, vec![1]);
                // The shards drop its state in the very step that preempts it.
                assert_eq!(out.step.as_ref().unwrap().removed, vec![1]);
                assert_eq!(computes(&out), vec![(0, 1)]);
                preempted_at = Some(n);
                break;
            }
        }
        assert!(preempted_at.is_some(), "the cache should run out");
        let victim = s.waiting().front().unwrap().clone();
        assert_eq!(victim.id, 1);
        assert!(victim.num_generated() > 0);
        assert!(!s.blocks().holds(1));
        // Finish request 0: request 1 re-joins with prompt + generated tokens.
        s.finish(0);
        let out = step(&mut s);
        let req = out.step.as_ref().unwrap();
        assert_eq!(req.removed, vec![0]);
        let joined = &req.joined[0];
        assert_eq!(joined.id, 1);
        assert_eq!(joined.prompt_len, 4);
        assert_eq!(joined.token_ids, victim.token_ids);
        assert_eq!(joined.num_compute as usize, victim.token_ids.len());
        assert_eq!(out.samples, vec![1]);
    }

    #[test]
    fn a_request_that_cannot_fit_alone_fails_instead_of_looping() {
        let mut s = Scheduler::new(config(64, 8, 2));
        s.add(seq(0, 7));
        let mut failed = false;
        for _ in 0..10 {
            let out = step(&mut s);
            if out.failed == vec![0] {
                failed = true;
                break;
            }
        }
        assert!(failed);
        assert!(!s.has_work());
        assert_eq!(s.blocks().num_free(), 2);
    }

    #[test]
    fn finishing_frees_blocks_and_reports_removal_once() {
        let mut s = Scheduler::new(config(64, 8, 10));
        s.add(seq(0, 5));
        s.add(seq(1, 5));
        step(&mut s);
        assert_eq!(s.blocks().num_free(), 6);
        s.finish(1);
        assert_eq!(s.blocks().num_free(), 8);
        let out = step(&mut s);
        assert_eq!(out.step.unwrap().removed, vec![1]);
        let out = step(&mut s);
        assert!(out.step.unwrap().removed.is_empty());
        // A waiting request that never joined leaves no removal.
        s.add(seq(2, 3));
        s.finish(2);
        let out = step(&mut s);
        assert!(out.step.unwrap().removed.is_empty());
    }

    #[test]
    fn random_workloads_keep_invariants_and_every_request_finishes() {
        use rand::rngs::StdRng;
        use rand::{Rng, SeedableRng};
        let mut rng = StdRng::seed_from_u64(3);
        for _ in 0..30 {
            let mut s = Scheduler::new(config(
                rng.random_range(1..40),
                rng.random_range(1..6),
                rng.random_range(8..30),
            ));
            let mut targets = std::collections::HashMap::new();
            let mut next_id = 0;
            let mut done = 0;
            for _ in 0..400 {
                if next_id < 20 && rng.random_bool(0.3) {
                    let prompt = rng.random_range(1..12);
                    targets.insert(next_id, rng.random_range(1..8));
                    s.add(seq(next_id, prompt));
                    next_id += 1;
                }
                let out = step(&mut s);
                if let Some(req) = &out.step {
                    assert!(out.num_tokens <= s.config.max_batch_tokens);
                    assert!(req.joined.len() + req.continuing.len() <= s.config.max_batch_size);
                }
                assert!(out.failed.is_empty());
                for id in out.samples {
                    if s.get(id).unwrap().num_generated() >= targets[&id] {
                        s.finish(id);
                        done += 1;
                    }
                }
                s.check_invariants().unwrap();
            }
            assert_eq!(done, next_id, "every request should finish");
            assert_eq!(s.blocks().num_free(), s.blocks().num_blocks());
        }
    }

    fn tokens_of(prefix: &[u32], rest: &[u32]) -> Vec<u32> {
        prefix.iter().chain(rest).copied().collect()
    }

    #[test]
    fn a_shared_prefix_is_computed_once_even_when_requests_arrive_together() {
        let mut s = Scheduler::new(SchedulerConfig::new(64, 8, 100, 4));
        let system: Vec<u32> = (0..10).collect(); // two full blocks + 2 tokens
        s.add(Sequence::new(
            0,
            tokens_of(&system, &[50, 51]),
            Default::default(),
        ));
        s.add(Sequence::new(
            1,
            tokens_of(&system, &[60]),
            Default::default(),
        ));
        let out = step(&mut s);
        // Request 1 would hit blocks the step is computing: it waits one step.
        assert_eq!(computes(&out), vec![(0, 12)]);
        assert_eq!(out.admitted, vec![0]);
        let out = step(&mut s);
        let joined = &out.step.as_ref().unwrap().joined[0];
        assert_eq!(
            (joined.id, joined.num_cached, joined.num_compute),
            (1, 8, 3)
        );
        assert_eq!(joined.block_table[..2], s.blocks().table(0)[..2]);
        assert_eq!((out.prefix_queried, out.prefix_hits), (11, 8));
        assert_eq!(s.blocks().refcount(s.blocks().table(0)[0]), 2);
        // Finished requests leave their full blocks cached, not used.
        s.finish(0);
        s.finish(1);
        assert_eq!(s.blocks().num_used(), 0);
        // Request 1's third block is not full, so three blocks stay cached.
        assert_eq!(s.blocks().num_cached(), 3);
        // Caching off: everything is computed.
        let mut c = SchedulerConfig::new(64, 8, 100, 4);
        c.prefix_caching = false;
        let mut s = Scheduler::new(c);
        s.add(Sequence::new(
            0,
            tokens_of(&system, &[50, 51]),
            Default::default(),
        ));
        s.add(Sequence::new(
            1,
            tokens_of(&system, &[60]),
            Default::default(),
        ));
        assert_eq!(computes(&step(&mut s)), vec![(0, 12), (1, 11)]);
    }

    #[test]
    fn a_request_asking_for_prompt_logprobs_skips_the_prefix_cache() {
        let mut s = Scheduler::new(SchedulerConfig::new(64, 8, 100, 4));
        let system: Vec<u32> = (0..10).collect();
        s.add(Sequence::new(
            0,
            tokens_of(&system, &[50]),
            Default::default(),
        ));
        step(&mut s);
        s.finish(0);
        let mut seq = Sequence::new(1, tokens_of(&system, &[60]), Default::default());
        seq.prompt_logprobs = true;
        s.add(seq);
        let out = step(&mut s);
        let joined = &out.step.as_ref().unwrap().joined[0];
        assert_eq!((joined.num_cached, joined.num_compute), (0, 11));
        assert!(joined.prompt_logprobs);
        s.check_invariants().unwrap();
    }

    #[test]
    fn generated_tokens_are_shareable_as_soon_as_their_block_is_full() {
        let mut s = Scheduler::new(SchedulerConfig::new(64, 8, 100, 4));
        s.add(seq(0, 3));
        for _ in 0..6 {
            step(&mut s); // 3 prompt tokens, then 1000, 1000, ... decoded
        }
        let running = s.get(0).unwrap().token_ids.clone();
        assert!(s.get(0).unwrap().num_computed >= 8);
        // A later prompt equal to request 0's first 8 tokens (prompt + generated) + 1.
        s.add(Sequence::new(
            1,
            tokens_of(&running[..8], &[7]),
            Default::default(),
        ));
        let out = step(&mut s);
        let joined = &out.step.as_ref().unwrap().joined[0];
        assert_eq!((joined.num_cached, joined.num_compute), (8, 1));
        assert_eq!(joined.block_table[..2], s.blocks().table(0)[..2]);
    }

    #[test]
    fn max_prefill_chunk_splits_a_long_prompt_while_decodes_run_every_step() {
        let mut c = config(64, 8, 100);
        c.max_prefill_chunk = 8;
        let mut s = Scheduler::new(c);
        s.add(seq(0, 2));
        s.add(seq(1, 2));
        step(&mut s);
        s.add(seq(2, 40));
        let mut chunks = Vec::new();
        while s.get(2).unwrap().num_generated() == 0 {
            let out = step(&mut s);
            let mut got = computes(&out);
            got.sort();
            assert_eq!(got[..2], [(0, 1), (1, 1)], "decodes run every step");
            chunks.push(got[2].1);
        }
        assert_eq!(chunks, vec![8, 8, 8, 8, 8]);
    }

    #[test]
    fn swap_preemption_moves_blocks_to_the_host_and_back_without_recomputing() {
        let mut c = config(64, 8, 4);
        c.preemption = Preemption::Swap;
        c.swap_blocks = 8;
        let mut s = Scheduler::new(c);
        s.add(seq(0, 4));
        s.add(seq(1, 4));
        let mut swapped_out = Vec::new();
        for _ in 0..12 {
            let out = step(&mut s);
            if !out.swapped_out.is_empty() {
                assert_eq!(out.swapped_out, vec![1]);
                assert!(out.preempted.is_empty());
                let req = out.step.as_ref().unwrap();
                assert_eq!(req.removed, vec![1]);
                swapped_out = req.swap_out.clone();
                // Its device blocks serve request 0 in the same step.
                break;
            }
        }
        assert!(!swapped_out.is_empty(), "the cache should run out");
        let victim = s.waiting().front().unwrap().clone();
        assert_eq!(victim.num_computed, victim.token_ids.len() - 1);
        assert_eq!(s.num_host_free(), 8 - swapped_out.len());
        s.finish(0);
        let out = step(&mut s);
        let req = out.step.as_ref().unwrap();
        let joined = &req.joined[0];
        assert_eq!(joined.id, 1);
        assert_eq!(joined.num_cached as usize, victim.num_computed);
        assert_eq!(joined.num_compute, 1, "swapped blocks are not recomputed");
        let hosts: Vec<u32> = req.swap_in.iter().map(|c| c.src).collect();
        let sent: Vec<u32> = swapped_out.iter().map(|c| c.dst).collect();
        assert_eq!(hosts, sent);
        let dst: Vec<u32> = req.swap_in.iter().map(|c| c.dst).collect();
        assert_eq!(dst[..], joined.block_table[..dst.len()]);
        step(&mut s);
        assert_eq!(s.num_host_free(), 8);
    }

    #[test]
    fn swap_falls_back_to_recompute_when_the_host_pool_is_full() {
        let mut c = config(64, 8, 4);
        c.preemption = Preemption::Swap;
        c.swap_blocks = 1;
        let mut s = Scheduler::new(c);
        s.add(seq(0, 4));
        s.add(seq(1, 4));
        let mut seen = false;
        for _ in 0..12 {
            let out = step(&mut s);
            if !out.preempted.is_empty() {
                assert!(out.swapped_out.is_empty());
                seen = true;
                break;
            }
        }
        assert!(seen);
    }

    #[test]
    fn forked_requests_copy_a_shared_partial_block_before_writing_it() {
        let mut s = Scheduler::new(SchedulerConfig::new(64, 8, 20, 4));
        s.add(seq(0, 6));
        step(&mut s); // computes 6, samples the 7th token
        assert!(s.fork(0, 10, 99));
        let shared = s.blocks().table(0)[1];
        let out = step(&mut s);
        let req = out.step.as_ref().unwrap();
        // The parent writes first (oldest): it gets the copy and re-joins with its new
        // table; the child joins on the original.
        assert_eq!(req.copies.len(), 1);
        assert_eq!(req.copies[0].src, shared);
        assert_eq!(req.removed, vec![0]);
        let ids: Vec<u64> = req.joined.iter().map(|j| j.id).collect();
        assert_eq!(ids, vec![0, 10]);
        assert_eq!(req.joined[0].block_table[1], req.copies[0].dst);
        assert_eq!(req.joined[1].block_table[1], shared);
        assert_eq!(req.joined[1].sampling.as_ref().unwrap().seed, 99);
        assert_eq!(s.blocks().table(0)[0], s.blocks().table(10)[0]);
        let out = step(&mut s);
        assert!(out.step.unwrap().copies.is_empty());
    }

    #[test]
    fn batching_modes_gate_admission() {
        let t0 = Instant::now();
        // none: one request at a time.
        let mut c = config(64, 8, 100);
        c.batching = Batching::None;
        let mut s = Scheduler::new(c);
        s.add(seq(0, 2));
        s.add(seq(1, 2));
        assert_eq!(computes(&step(&mut s)), vec![(0, 2)]);
        assert_eq!(computes(&step(&mut s)), vec![(0, 1)]);
        s.finish(0);
        assert_eq!(computes(&step(&mut s)), vec![(1, 2)]);

        // static: a batch of what waits; later arrivals wait until every member is done.
        let mut c = config(64, 2, 100);
        c.batching = Batching::Static;
        let mut s = Scheduler::new(c);
        s.add(seq(0, 2));
        s.add(seq(1, 2));
        s.add(seq(2, 2));
        assert_eq!(computes(&step(&mut s)), vec![(0, 2), (1, 2)]);
        s.finish(0);
        assert_eq!(computes(&step(&mut s)), vec![(1, 1)]);
        s.finish(1);
        assert_eq!(computes(&step(&mut s)), vec![(2, 2)]);

        // dynamic: waits for a full batch or the timeout.
        let mut c = config(64, 3, 100);
        c.batching = Batching::Dynamic;
        c.batch_timeout = Duration::from_millis(10);
        let mut s = Scheduler::new(c);
        let mut a = seq(0, 2);
        a.arrived = t0;
        s.add(a);
        let out = step_at(&mut s, t0);
        assert!(out.step.is_none());
        assert_eq!(out.wake_at, Some(t0 + Duration::from_millis(10)));
        let out = step_at(&mut s, t0 + Duration::from_millis(11));
        assert_eq!(computes(&out), vec![(0, 2)]);
        s.add(seq(1, 2));
        s.add(seq(2, 2));
        s.add(seq(3, 2));
        // The running batch takes nobody; once it is done, three waiting fill a batch.
        let out = step_at(&mut s, t0 + Duration::from_millis(12));
        assert_eq!(computes(&out), vec![(0, 1)]);
        s.finish(0);
        let out = step_at(&mut s, t0 + Duration::from_millis(12));
        assert_eq!(computes(&out), vec![(1, 2), (2, 2), (3, 2)]);
    }

    /// A model of the shards' KV: the token each slot holds. Applies every Step in the
    /// contract's order and checks that cached positions hold the request's tokens and
    /// that nothing writes a block another live request holds.
    #[derive(Default)]
    struct KvModel {
        device: HashMap<u32, Vec<Option<u32>>>,
        host: HashMap<u32, Vec<Option<u32>>>,
        reqs: HashMap<u64, (Vec<u32>, usize, Vec<u32>)>,
    }

    impl KvModel {
        fn apply(&mut self, req: &pb::StepRequest, bs: usize) {
            for id in &req.removed {
                self.reqs.remove(id);
            }
            let empty = vec![None; bs];
            for c in &req.swap_out {
                let v = self.device.get(&c.src).cloned().unwrap_or(empty.clone());
                self.host.insert(c.dst, v);
            }
            for c in &req.swap_in {
                let v = self.host[&c.src].clone();
                self.device.insert(c.dst, v);
            }
            for c in &req.copies {
                let v = self.device.get(&c.src).cloned().unwrap_or(empty.clone());
                self.device.insert(c.dst, v);
            }
            let mut rows = Vec::new();
            for j in &req.joined {
                for p in 0..j.num_cached as usize {
                    let b = j.block_table[p / bs];
                    let held = self.device.get(&b).and_then(|v| v[p % bs]);
                    assert_eq!(held, Some(j.token_ids[p]), "request {} position {p}", j.id);
                }
                let state = (
                    j.token_ids.clone(),
                    j.num_cached as usize,
                    j.block_table.clone(),
                );
                self.reqs.insert(j.id, state);
                rows.push((j.id, j.num_compute as usize));
            }
            for c in &req.continuing {
                self.reqs.get_mut(&c.id).unwrap().2.extend(&c.new_blocks);
                rows.push((c.id, c.num_compute as usize));
            }
            for (id, n) in rows {
                let (tokens, computed, table) = self.reqs[&id].clone();
                for p in computed..computed + n {
                    let b = table[p / bs];
                    let holders = self.reqs.values().filter(|r| r.2.contains(&b)).count();
                    assert_eq!(holders, 1, "request {id} writes block {b} that others hold");
                    self.device.entry(b).or_insert(empty.clone())[p % bs] = Some(tokens[p]);
                }
                let r = self.reqs.get_mut(&id).unwrap();
                r.1 += n;
                if r.1 == r.0.len() {
                    r.0.push(1000 + id as u32);
                }
            }
        }
    }

    #[test]
    fn random_workloads_under_every_policy_match_the_kv_model_and_finish() {
        use rand::rngs::StdRng;
        use rand::{Rng, SeedableRng};
        let mut rng = StdRng::seed_from_u64(11);
        for round in 0..200 {
            let mut c = config(
                rng.random_range(1..40),
                rng.random_range(1..6),
                rng.random_range(8..30),
            );
            c.prefix_caching = rng.random_bool(0.7);
            c.max_prefill_chunk = rng.random_range(0..6);
            if rng.random_bool(0.5) {
                c.preemption = Preemption::Swap;
                c.swap_blocks = rng.random_range(0..40);
            }
            c.batching = [
                Batching::Continuous,
                Batching::Static,
                Batching::None,
                Batching::Dynamic,
            ][round % 4];
            c.batch_timeout = Duration::ZERO;
            let mut s = Scheduler::new(c);
            let mut model = KvModel::default();
            let mut targets = HashMap::new();
            let mut next_id = 0;
            let mut done = 0;
            for _ in 0..600 {
                if next_id < 16 && rng.random_bool(0.3) {
                    let len = rng.random_range(1..14);
                    // Two-letter vocabulary: plenty of shared prefixes.
                    let prompt = (0..len).map(|_| rng.random_range(0..2)).collect();
                    targets.insert(next_id, rng.random_range(1..8));
                    s.add(Sequence::new(next_id, prompt, Default::default()));
                    next_id += 1;
                }
                let out = s.schedule();
                if let Some(req) = &out.step {
                    assert!(out.num_tokens <= s.config.max_batch_tokens);
                    assert!(req.joined.len() + req.continuing.len() <= s.config.max_batch_size);
                    model.apply(req, 4);
                }
                for &id in &out.samples {
                    assert!(s.append_tokens(id, &[1000 + id as u32]));
                }
                s.check_invariants().unwrap();
                assert!(out.failed.is_empty());
                for id in out.samples {
                    if s.get(id).unwrap().num_generated() >= targets[&id] {
                        s.finish(id);
                        done += 1;
                    }
                }
                s.check_invariants().unwrap();
            }
            assert_eq!(done, next_id, "every request should finish ({c:?})");
            assert_eq!(s.blocks().num_used(), 0);
            assert_eq!(s.blocks().num_free(), s.blocks().num_blocks());
        }
    }
}
