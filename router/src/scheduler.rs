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

use std::collections::HashSet;
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

/// What a decoding request proposes to follow its sampled token at its next step
/// (speculative decoding), set by the batching loop before each schedule.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Proposal {
    #[default]
    None,
    /// Tokens the router proposes (n-gram lookup, or the synthetic benchmark proposer).
    Tokens(Vec<u32>),
    /// This many tokens for the shard's draft model to propose.
    Draft(usize),
}

impl Proposal {
    fn len(&self) -> usize {
        match self {
            Proposal::None => 0,
            Proposal::Tokens(t) => t.len(),
            Proposal::Draft(k) => *k,
        }
    }

    /// The first `k` proposals.
    fn take(self, k: usize) -> Proposal {
        match self {
            Proposal::None => Proposal::None,
            _ if k == 0 => Proposal::None,
            Proposal::Tokens(mut t) => {
                t.truncate(k);
                Proposal::Tokens(t)
            }
            Proposal::Draft(n) => Proposal::Draft(n.min(k)),
        }
    }
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
    /// The id its log lines carry (`request_id`), sent to the shards with it.
    pub request_id: std::sync::Arc<str>,
    pub num_preemptions: u32,
    /// The shards return the prompt tokens' logprobs with the first sampled token.
    pub prompt_logprobs: bool,
    pub arrived: Instant,
    /// Host blocks holding its KV while swapped out, in table order.
    pub swapped: Vec<u32>,
    /// Whether it has ever been admitted (left the queue for the first time).
    pub started: bool,
    /// Sampled tokens the shards know and the router does not yet (0 or 1: the step in
    /// flight when the next one was scheduled ahead).
    pub pending: usize,
    /// It generates at most this many tokens: never scheduled past them.
    pub max_new_tokens: usize,
    /// Trailing tokens of `token_ids` the router appended without the shards sampling
    /// them (forced by a grammar); sent with its next continuing step.
    pub forced_unsent: usize,
    /// Speculative decoding: what it proposes at its next decode (consumed by the schedule).
    pub proposal: Proposal,
    /// Proposals in the step in flight, computed but not yet verified: the shards' answer
    /// says how many of them count (`Scheduler::verified`).
    pub verifying: usize,
    /// KV-pool blocks its adapter's weights take, known once the adapter's host load has
    /// finished (`adapter_loaded`); None before that, and without an adapter.
    pub adapter_blocks: Option<usize>,
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
            request_id: "".into(),
            num_preemptions: 0,
            prompt_logprobs: false,
            arrived: Instant::now(),
            swapped: Vec::new(),
            started: false,
            pending: 0,
            max_new_tokens: usize::MAX,
            forced_unsent: 0,
            proposal: Proposal::None,
            verifying: 0,
            adapter_blocks: None,
            in_batch: false,
        }
    }

    fn has_adapter(&self) -> bool {
        !self.adapter_id.is_empty()
    }

    /// Its adapter's host load has not finished: it cannot join yet.
    fn awaits_adapter(&self) -> bool {
        self.has_adapter() && self.adapter_blocks.is_none()
    }

    /// Tokens whose KV it holds once it has generated every token it may (its last sampled
    /// token needs none); without a token limit, its known tokens.
    fn final_kv_tokens(&self) -> usize {
        let len = self.token_ids.len();
        if self.max_new_tokens == usize::MAX {
            return len;
        }
        let left = self.max_new_tokens.saturating_sub(self.num_generated());
        len + left.saturating_sub(1)
    }

    pub fn num_generated(&self) -> usize {
        self.token_ids.len() - self.prompt_len
    }

    /// Tokens to compute before it samples: the known ones, and the pending one.
    fn remaining(&self) -> usize {
        self.token_ids.len() + self.pending - self.num_computed
    }

    /// It decodes at the next step (it has sampled, the token is known, nothing is forced
    /// or pending): what a proposal can follow.
    pub fn decodes_next(&self) -> bool {
        self.on_shard
            && self.pending == 0
            && self.forced_unsent == 0
            && self.remaining() == 1
            && !self.at_limit()
    }

    /// Its last allowed token is known or pending: nothing more to compute.
    fn at_limit(&self) -> bool {
        self.num_generated() + self.pending >= self.max_new_tokens
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
    /// Speculative decoding: proposals are added to a step only while it holds at most this
    /// many tokens (0: no speculation).
    pub speculative_max_step_tokens: usize,
    /// Most distinct LoRA adapters among the running requests.
    pub max_adapters_per_batch: usize,
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
    /// Free host block ids; the next one handed out is at the end.
    host_free: Vec<u32>,
    /// Host blocks read by this step's swap-ins: free once it has run.
    host_released: Vec<u32>,
    step_id: u64,
    /// Adapters evicted and not yet sent in a step's `adapters_out`.
    adapters_out: Vec<String>,
    /// Adapters being unloaded: evicted as soon as no running request uses them.
    doomed: HashSet<String>,
}

/// One request's share of the step being built.
struct Planned {
    id: RequestId,
    n: usize,
    /// Proposals among the `n` tokens (speculative decoding): all but the first.
    proposal: Proposal,
}

/// The step being built: who computes how many tokens, the block moves it carries, the
/// token budget left, and what the schedule reports.
struct Draft {
    budget: usize,
    plan: Vec<Planned>,
    copies: Vec<pb::BlockCopy>,
    swap_out: Vec<pb::BlockCopy>,
    swap_in: Vec<pb::BlockCopy>,
    /// Adapters paged in for the requests this step admits.
    adapters_in: Vec<pb::AdapterPages>,
    out: Schedule,
}

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

impl Draft {
    fn new(budget: usize) -> Self {
        Self {
            budget,
            plan: Vec::new(),
            copies: Vec::new(),
            swap_out: Vec::new(),
            swap_in: Vec::new(),
            adapters_in: Vec::new(),
            out: Schedule::default(),
        }
    }

    /// Whether this step preempted a running request.
    fn preempted(&self) -> bool {
        !self.out.preempted.is_empty() || !self.out.swapped_out.is_empty()
    }
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
            adapters_out: Vec::new(),
            doomed: HashSet::new(),
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

    /// A request joins the batch with its adapter: a reference on it when resident, else
    /// it is paged in (its blocks taken, which the admission checked) with this step.
    fn use_adapter(&mut self, seq: &Sequence, draft: &mut Draft) {
        if !seq.has_adapter() || self.blocks.acquire_adapter(&seq.adapter_id) {
            return;
        }
        let num_blocks = seq.adapter_blocks.expect("only loaded adapters join");
        let blocks = self
            .blocks
            .page_in(&seq.adapter_id, num_blocks)
            .expect("the need was checked");
        draft.adapters_in.push(pb::AdapterPages {
            name: seq.adapter_id.clone(),
            blocks,
        });
    }

    /// A request left the batch: its reference on its adapter goes, and an adapter being
    /// unloaded leaves the pool with its last user.
    fn leave_adapter(&mut self, seq: &Sequence) {
        if !seq.has_adapter() {
            return;
        }
        let users = self.blocks.release_adapter(&seq.adapter_id);
        if users == 0 && self.doomed.contains(&seq.adapter_id) {
            self.blocks.evict_adapter(&seq.adapter_id);
            self.adapters_out.extend(self.blocks.take_evicted());
        }
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
        Ok(())
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
        seq.proposal = Proposal::None;
        // The parent's sample (pending until applied) is its own, not the child's.
        seq.pending = 0;
        if seq.remaining() == 0 {
            seq.num_computed -= 1;
        }
        self.blocks.fork(parent, child);
        if seq.has_adapter() {
            let resident = self.blocks.acquire_adapter(&seq.adapter_id);
            debug_assert!(resident, "a running parent's adapter is resident");
        }
        self.running.push(seq);
        true
    }

    /// Retires a request (finished, cancelled or failed): frees its blocks now and tells
    /// the shards to drop its state at the next step.
    pub fn finish(&mut self, id: RequestId) -> Option<Sequence> {
        let mut seq = match self.running_index(id) {
            Some(i) => {
                let seq = self.running.remove(i);
                self.leave_adapter(&seq);
                seq
            }
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
        // A new session starts with no adapter paged in on the shards.
        self.blocks.clear_adapters();
        self.adapters_out.clear();
        self.removed.clear();
        ids
    }

    /// Preempts `seq` (already out of `running`): by swapping when asked and the host
    /// pool has room, else by recomputation.
    fn preempt(&mut self, mut seq: Sequence, draft: &mut Draft) {
        self.leave_adapter(&seq);
        let table = self.blocks.table(seq.id);
        let swap = self.config.preemption == Preemption::Swap
            && seq.on_shard
            && !table.is_empty()
            && table.len() <= self.host_free.len();
        if swap {
            for &src in table {
                let dst = self.host_free.pop().expect("checked above");
                draft.swap_out.push(pb::BlockCopy { src, dst });
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
        seq.proposal = Proposal::None;
        seq.num_preemptions += 1;
        if swap {
            draft.out.swapped_out.push(seq.id);
        } else {
            draft.out.preempted.push(seq.id);
        }
        self.waiting.push_front(seq);
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
    fn plan_tokens(&mut self, draft: &mut Draft, id: RequestId, n: usize) {
        draft.plan.push(Planned {
            id,
            n,
            proposal: Proposal::None,
        });
        draft.budget -= n;
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
        let mut draft = self.begin_step();
        // 1. Running decodes; the latest arrival is preempted when blocks run out, and
        //    the decode that was short of them retries.
        let mut from = 0;
        while let Some(i) = self.plan_decodes(&mut draft, from) {
            self.preempt_latest(i, &mut draft);
            from = i;
        }
        // 2. Running prefills; a chunk without a block preempts or waits.
        let mut from = 0;
        while let Some(i) = self.plan_prefills(&mut draft, from) {
            from = self.make_room_for_prefill(i, &mut draft);
        }
        // 3. Waiting requests, unless this step had to preempt (they would thrash).
        if !draft.preempted() {
            self.admit(now, &mut draft);
        }
        // 4. Proposals onto the planned decodes, while the step stays small.
        self.add_proposals(&mut draft);
        self.build_step(draft)
    }

    /// Adds each planned decode's proposal (oldest first) while the step stays within
    /// `speculative_max_step_tokens` and the budget, the request's token limit and the free
    /// blocks allow (no copy, no preemption for a proposal). With speculation on, every
    /// request's proposal is consumed: the loop sets a fresh one before each schedule.
    fn add_proposals(&mut self, draft: &mut Draft) {
        let limit = self.config.speculative_max_step_tokens;
        if limit == 0 {
            return; // speculation is off: nobody proposes
        }
        let mut total: usize = draft.plan.iter().map(|p| p.n).sum();
        for p in 0..draft.plan.len() {
            let id = draft.plan[p].id;
            let i = self
                .running_index(id)
                .expect("planned requests are running");
            let seq = &mut self.running[i];
            let proposal = std::mem::take(&mut seq.proposal);
            if draft.plan[p].n != 1 || !seq.decodes_next() || proposal.len() == 0 {
                continue;
            }
            let room = seq
                .max_new_tokens
                .saturating_sub(seq.num_generated() + 1)
                .min(draft.budget);
            let wanted = proposal.len().min(room);
            let k = wanted.min(limit.saturating_sub(total));
            if wanted > 0 && k == 0 {
                draft.out.speculation_off += 1;
            }
            let from = seq.num_computed;
            if k == 0
                || self.blocks.copies_needed(id, from, from + 1 + k) > 0
                || !self.blocks.grow_to(id, from + 1 + k)
            {
                continue;
            }
            draft.budget -= k;
            total += k;
            draft.plan[p].n += k;
            draft.plan[p].proposal = proposal.take(k);
            draft.out.speculating += 1;
            draft.out.proposed_tokens += k;
        }
    }

    /// Decides the next step while the previous one runs: see the module documentation.
    /// Nothing (an empty schedule) when the running requests are short of blocks: the
    /// ordinary schedule, once the step in flight is applied, preempts as it should.
    pub fn schedule_ahead(&mut self) -> Schedule {
        if self.short_of_blocks() {
            return Schedule::default();
        }
        let now = Instant::now();
        let mut draft = self.begin_step();
        // Proposals follow the last token, which is pending here: none ahead.
        for seq in &mut self.running {
            seq.proposal = Proposal::None;
        }
        // 1. and 2. as `schedule_at`, except that nothing is preempted ahead: a request
        //    short of blocks waits for the next step.
        let mut starved = false;
        let mut from = 0;
        while let Some(i) = self.plan_decodes(&mut draft, from) {
            starved = true;
            from = i + 1;
        }
        let mut from = 0;
        while let Some(i) = self.plan_prefills(&mut draft, from) {
            starved = true;
            from = i + 1;
        }
        // 3. Waiting requests, unless a running request was left waiting for blocks.
        if !starved {
            self.admit(now, &mut draft);
        }
        self.build_step(draft)
    }

    /// Whether the running decodes need more blocks (new ones, copies) than are free, or
    /// leave none for a running prefill.
    fn short_of_blocks(&self) -> bool {
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

    /// Starts a step: the previous one has run, so its blocks are hit-able and its
    /// swapped-in host blocks free.
    fn begin_step(&mut self) -> Draft {
        self.blocks.mark_ready();
        self.host_free.append(&mut self.host_released);
        Draft::new(self.config.max_batch_tokens)
    }

    /// Plans one token for each running request from the `from`-th on that has caught
    /// up (oldest first), taking a block when its last is full. Stops at the first that
    /// is short of blocks and returns its index.
    fn plan_decodes(&mut self, draft: &mut Draft, from: usize) -> Option<usize> {
        let mut i = from;
        while i < self.running.len() && draft.budget > 0 {
            let seq = &self.running[i];
            if seq.remaining() == 1 && !seq.at_limit() {
                if !self.take_blocks(i, 1, &mut draft.copies) {
                    return Some(i);
                }
                self.plan_tokens(draft, self.running[i].id, 1);
            }
            i += 1;
        }
        None
    }

    /// Frees blocks for running request `i`'s decode by preempting the latest arrival
    /// (possibly `i` itself); fails `i` when it is alone and still short.
    fn preempt_latest(&mut self, i: usize, draft: &mut Draft) {
        let id = self.running[i].id;
        let victim = self.running.pop().expect("running is not empty");
        if victim.id == id && self.running.is_empty() {
            // It cannot fit even with the whole cache to itself.
            self.drop_failed(victim);
            draft.out.failed.push(id);
        } else {
            self.preempt(victim, draft);
        }
    }

    /// Plans the next prompt chunk of each running request from the `from`-th on that
    /// has more than one token to compute (oldest first), shrunk to the free blocks
    /// rather than preempting. Stops at the first that cannot get even one block and
    /// returns its index.
    fn plan_prefills(&mut self, draft: &mut Draft, from: usize) -> Option<usize> {
        let mut i = from;
        while i < self.running.len() && draft.budget > 0 {
            let seq = &self.running[i];
            if seq.remaining() > 1 {
                let id = seq.id;
                let mut n = self.chunk(seq, draft.budget);
                let fits = self.fits(seq);
                if fits > 0 && fits < n {
                    n = fits;
                }
                if fits == 0 || !self.take_blocks(i, n, &mut draft.copies) {
                    return Some(i);
                }
                self.plan_tokens(draft, id, n);
            }
            i += 1;
        }
        None
    }

    /// Running request `i`'s prefill has no block: preempts a later arrival that has
    /// nothing planned, or fails `i` when it is alone, or leaves it to wait for decodes
    /// to finish (they preempt when they need to). Returns where the prefills go on.
    fn make_room_for_prefill(&mut self, i: usize, draft: &mut Draft) -> usize {
        let id = self.running[i].id;
        let victim = self
            .running
            .iter()
            .rposition(|s| s.id > id && !draft.plan.iter().any(|p| p.id == s.id));
        match victim {
            Some(v) => {
                let victim = self.running.remove(v);
                self.preempt(victim, draft);
                i
            }
            None if self.running.len() == 1 => {
                let seq = self.running.remove(i);
                self.drop_failed(seq);
                draft.out.failed.push(id);
                i
            }
            None => i + 1,
        }
    }

    /// The step's diff (4th in the module documentation), when it computes or moves
    /// anything (blocks, or adapters out of the pool); else the removals wait for the next
    /// real step.
    fn build_step(&mut self, draft: Draft) -> Schedule {
        let Draft {
            plan,
            copies,
            swap_out,
            swap_in,
            adapters_in,
            mut out,
            ..
        } = draft;
        self.adapters_out.extend(self.blocks.take_evicted());
        if plan.is_empty() && swap_out.is_empty() && self.adapters_out.is_empty() {
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
        for Planned { id, n, proposal } in plan {
            let proposed = proposal.len();
            let i = self
                .running_index(id)
                .expect("planned requests are running");
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

    fn drop_failed(&mut self, mut seq: Sequence) {
        self.leave_adapter(&seq);
        self.blocks.free(seq.id);
        self.host_free.append(&mut seq.swapped);
        if seq.on_shard {
            self.removed.push(seq.id);
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

    /// Plans the waiting requests (3rd in the module documentation): in arrival order, as
    /// the batching mode, the budget, the batch size and the free blocks allow; a prompt's
    /// cached prefix is shared, not computed. Requests whose adapter cannot join yet are
    /// passed over and keep their place.
    fn admit(&mut self, now: Instant, draft: &mut Draft) {
        let cap = match self.config.batching {
            Batching::None => 1,
            _ => self.config.max_batch_size,
        };
        let mut i = 0;
        while draft.budget > 0 && self.running.len() < cap && self.may_admit(i, now, &mut draft.out)
        {
            match self.admit_at(i, draft) {
                Admitted::Joined | Admitted::Refused => {}
                Admitted::Passed => i += 1,
                Admitted::Wait => break,
            }
        }
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

    /// Admits waiting request `i` if it can join now (see `Admitted`).
    fn admit_at(&mut self, i: usize, draft: &mut Draft) -> Admitted {
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
            self.host_free.extend(&seq.swapped);
            draft.out.refused.push((id, message));
            return Admitted::Refused;
        }
        if !seq.swapped.is_empty() {
            // Swapped out: its blocks come back from the host, then it goes on.
            let n = self.chunk(seq, draft.budget);
            let need = self.blocks.blocks_for(seq.num_computed + n);
            if need + adapter_need > self.blocks.num_free() {
                return Admitted::Wait;
            }
            let mut seq = self.waiting.remove_at(i).expect("it is there");
            self.use_adapter(&seq, draft);
            let grown = self.blocks.grow_to(id, seq.num_computed + n);
            debug_assert!(grown);
            let table = self.blocks.table(id);
            for (&src, &dst) in seq.swapped.iter().zip(table) {
                draft.swap_in.push(pb::BlockCopy { src, dst });
            }
            self.host_released.append(&mut seq.swapped);
            self.join(seq, n, draft);
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
        let n = (seq.token_ids.len() - cached).min(draft.budget);
        let n = match self.config.max_prefill_chunk {
            0 => n,
            c if seq.token_ids.len() - cached > 1 => n.min(c),
            _ => n,
        };
        // The whole chunk must fit: a newcomer squeezed into the last free blocks
        // would only be preempted by the next decode that needs a block.
        let need = self.blocks.blocks_for(cached + n) - m.blocks.len();
        if need + adapter_need > self.blocks.num_free() - self.blocks.unused_in(&m) {
            return Admitted::Wait;
        }
        if self.blocks.caching() {
            draft.out.prefix_queried += seq.token_ids.len();
            draft.out.prefix_hits += cached;
        }
        let mut seq = self.waiting.remove_at(i).expect("it is there");
        // The matched blocks first, so that paging the adapter in cannot evict them.
        self.blocks.adopt_prefix(id, &m);
        self.use_adapter(&seq, draft);
        let grown = self.blocks.grow_to(id, cached + n);
        debug_assert!(grown, "the need was checked");
        seq.num_computed = cached;
        if !seq.started {
            seq.started = true;
            draft.out.admitted.push(id);
        }
        self.join(seq, n, draft);
        Admitted::Joined
    }

    /// Puts an admitted request among the running ones, in arrival order, with its
    /// first `n` tokens planned.
    fn join(&mut self, seq: Sequence, n: usize, draft: &mut Draft) {
        let id = seq.id;
        let pos = self.running.partition_point(|s| s.id < id);
        self.running.insert(pos, seq);
        self.plan_tokens(draft, id, n);
    }

    /// Every running request's adapter is resident, each resident adapter counts exactly
    /// the running requests that use it, and the batch holds at most
    /// `max_adapters_per_batch` of them.
    fn check_adapters(&self) -> Result<(), String> {
        let mut users: std::collections::HashMap<&str, usize> = Default::default();
        for seq in self.running.iter().filter(|s| s.has_adapter()) {
            *users.entry(seq.adapter_id.as_str()).or_default() += 1;
        }
        for (name, &n) in &users {
            if self.blocks.adapter_users(name) != Some(n) {
                return Err(format!(
                    "adapter {name}: {n} running users, resident with {:?}",
                    self.blocks.adapter_users(name)
                ));
            }
        }
        for (name, n) in self.blocks.resident_adapters() {
            if n != users.get(name).copied().unwrap_or(0) {
                return Err(format!("resident adapter {name} counts {n} users"));
            }
        }
        if users.len() > self.config.max_adapters_per_batch {
            return Err(format!(
                "{} adapters in the batch, at most {}",
                users.len(),
                self.config.max_adapters_per_batch
            ));
        }
        Ok(())
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
            let unverified = seq.num_computed + seq.verifying;
            if held * bs < unverified || held > self.blocks.blocks_for(unverified) {
                return Err(format!(
                    "request {} computed {} tokens in {held} blocks",
                    seq.id, seq.num_computed
                ));
            }
            if !seq.swapped.is_empty() {
                return Err(format!("running request {} is swapped out", seq.id));
            }
        }
        self.check_adapters()?;
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
mod tests;
