//! The scheduling decision, free of I/O: given the running requests, the waiting queue,
//! the free KV blocks and the step budgets, decide what every request computes this step
//! and express it as the `StepRequest` diff the shards apply.
//!
//! As in vLLM V1, a step is `{request: tokens to compute}`: each request's computed count
//! catches up with its known-token count (prompt, then sampled tokens). A prefill chunk
//! and a decode are the same thing; a request samples when it has caught up.
//!
//! Order of business each step:
//! 1. running requests, oldest first: the next prefill chunk or one decode token, taking a
//!    block when the last one is full; when none is free the most recently arrived running
//!    request is preempted by recomputation (blocks dropped, back to the front of the
//!    queue with the tokens it generated, re-joins later as a new request);
//! 2. waiting requests, first come first served, while the token budget, the batch size
//!    and the free blocks allow (a long prompt is prefilled in chunks across steps).

use crate::blocks::{BlockAllocator, RequestId};
use crate::pb;
use crate::queue::Queue;

/// The scheduler's view of one request.
#[derive(Debug, Clone)]
pub struct Sequence {
    /// Assigned in arrival order, so a smaller id arrived earlier.
    pub id: RequestId,
    /// Every known token: the prompt, then the generated ones.
    pub token_ids: Vec<u32>,
    pub prompt_len: usize,
    /// Leading tokens whose KV is in this request's blocks (on the shards).
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
    /// Requests preempted this step (already back in the queue).
    pub preempted: Vec<RequestId>,
    /// Tokens computed by this step.
    pub num_tokens: usize,
}

#[derive(Debug)]
pub struct Scheduler {
    config: SchedulerConfig,
    waiting: Queue,
    /// Sorted by id (arrival order).
    running: Vec<Sequence>,
    blocks: BlockAllocator,
    /// Ids whose shard state must be dropped at the next step.
    removed: Vec<RequestId>,
    step_id: u64,
}

impl Scheduler {
    pub fn new(config: SchedulerConfig) -> Self {
        Self {
            blocks: BlockAllocator::new(config.num_blocks, config.block_size),
            config,
            waiting: Queue::default(),
            running: Vec::new(),
            removed: Vec::new(),
            step_id: 0,
        }
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

    pub fn blocks(&self) -> &BlockAllocator {
        &self.blocks
    }

    pub fn running(&self) -> &[Sequence] {
        &self.running
    }

    pub fn waiting(&self) -> &Queue {
        &self.waiting
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

    /// Retires a request (finished, cancelled or failed): frees its blocks now and tells
    /// the shards to drop its state at the next step.
    pub fn finish(&mut self, id: RequestId) -> Option<Sequence> {
        let seq = match self.running_index(id) {
            Some(i) => self.running.remove(i),
            None => self.waiting.remove(id)?,
        };
        self.blocks.free(id);
        if seq.on_shard {
            self.removed.push(id);
        }
        Some(seq)
    }

    /// Forgets every request and block (after a shard failure; the shards are cleared
    /// separately). Returns the ids that were in flight.
    pub fn reset(&mut self) -> Vec<RequestId> {
        let mut ids: Vec<RequestId> = self.running.drain(..).map(|s| s.id).collect();
        ids.extend(self.waiting.drain().map(|s| s.id));
        for &id in &ids {
            self.blocks.free(id);
        }
        self.removed.clear();
        ids
    }

    fn preempt(&mut self, mut seq: Sequence) {
        self.blocks.free(seq.id);
        if seq.on_shard {
            self.removed.push(seq.id);
        }
        seq.on_shard = false;
        seq.num_computed = 0;
        seq.blocks_sent = 0;
        seq.num_preemptions += 1;
        self.waiting.push_front(seq);
    }

    /// Most tokens `seq` can compute from its current position with the free blocks.
    fn fits(&self, seq: &Sequence) -> usize {
        let capacity =
            (self.blocks.table(seq.id).len() + self.blocks.num_free()) * self.blocks.block_size();
        capacity.saturating_sub(seq.num_computed)
    }

    /// Decides the next step. See the module documentation for the policy.
    pub fn schedule(&mut self) -> Schedule {
        let mut out = Schedule::default();
        let mut budget = self.config.max_batch_tokens;
        let mut plan: Vec<(RequestId, usize)> = Vec::new();

        // 1. Running requests, oldest first.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let seq = &self.running[i];
            let (id, remaining) = (seq.id, seq.remaining());
            if remaining == 0 {
                i += 1;
                continue;
            }
            let mut n = remaining.min(budget);
            let fits = self.fits(seq);
            if fits < n && fits > 0 {
                // A prefill chunk shrinks to the free blocks rather than preempting.
                n = fits;
            }
            if self.blocks.grow_to(id, self.running[i].num_computed + n) {
                plan.push((id, n));
                budget -= n;
                i += 1;
                continue;
            }
            // No block free: preempt the latest arrival (possibly this request itself).
            let victim = self.running.pop().expect("running is not empty");
            let alone = self.running.is_empty();
            out.preempted.push(victim.id);
            if victim.id == id && alone {
                // It cannot fit even with the whole cache to itself.
                self.blocks.free(id);
                if victim.on_shard {
                    self.removed.push(id);
                }
                out.preempted.pop();
                out.failed.push(id);
            } else {
                self.preempt(victim);
            }
            // Retry the same request (now with more blocks free), unless it was the victim.
        }

        // 2. Waiting requests, unless this step had to preempt (they would thrash).
        while out.preempted.is_empty()
            && budget > 0
            && self.running.len() < self.config.max_batch_size
        {
            let Some(seq) = self.waiting.front() else {
                break;
            };
            // The whole chunk must fit: a newcomer squeezed into the last free blocks
            // would only be preempted by the next decode that needs a block.
            let n = seq.remaining().min(budget);
            if n > self.fits(seq) {
                break;
            }
            let mut seq = self.waiting.pop_front().expect("front exists");
            let grown = self.blocks.grow_to(seq.id, seq.num_computed + n);
            debug_assert!(grown, "fits() promised the blocks");
            seq.blocks_sent = 0;
            let id = seq.id;
            let pos = self.running.partition_point(|s| s.id < id);
            self.running.insert(pos, seq);
            plan.push((id, n));
            budget -= n;
        }

        let removed = std::mem::take(&mut self.removed);
        if plan.is_empty() {
            // Keep the removals for the next real step.
            self.removed = removed;
            return out;
        }

        // 3. The diff.
        let mut step = pb::StepRequest {
            step_id: self.step_id,
            removed,
            ..Default::default()
        };
        self.step_id += 1;
        for (id, n) in plan {
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

    /// Checks the bookkeeping (tests and debug builds).
    pub fn check_invariants(&self) -> Result<(), String> {
        self.blocks.check_invariants()?;
        if !self.running.windows(2).all(|w| w[0].id < w[1].id) {
            return Err("running is not sorted by arrival".into());
        }
        if self.running.len() > self.config.max_batch_size {
            return Err("running exceeds max_batch_size".into());
        }
        for seq in &self.running {
            let held = self.blocks.table(seq.id).len() * self.blocks.block_size();
            if held < seq.num_computed {
                return Err(format!(
                    "request {} computed {} tokens in {held} slots",
                    seq.id, seq.num_computed
                ));
            }
        }
        for seq in self.waiting.iter() {
            if self.blocks.holds(seq.id) || seq.on_shard || seq.num_computed != 0 {
                return Err(format!("waiting request {} holds resources", seq.id));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(
        max_batch_tokens: usize,
        max_batch_size: usize,
        num_blocks: usize,
    ) -> SchedulerConfig {
        SchedulerConfig {
            max_batch_tokens,
            max_batch_size,
            num_blocks,
            block_size: 4,
        }
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
}
