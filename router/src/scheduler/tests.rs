//! The scheduler's tests: each step is played against a stand-in shard that samples
//! token `1000 + id` for every request that caught up, and the bookkeeping invariants
//! are checked after every step.

use std::collections::HashMap;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;

/// Tokens per KV block in every test.
const BLOCK_SIZE: usize = 4;

/// A scheduler under test, configured by chaining: continuous batching, recompute
/// preemption, no chunk limit and, unlike the default, no prefix caching (most of these
/// prompts start alike).
struct Setup {
    config: SchedulerConfig,
}

fn setup(max_batch_tokens: usize, max_batch_size: usize, num_blocks: usize) -> Setup {
    let mut config = SchedulerConfig::new(max_batch_tokens, max_batch_size, num_blocks, BLOCK_SIZE);
    config.prefix_caching = false;
    Setup { config }
}

impl Setup {
    fn prefix_caching(mut self) -> Self {
        self.config.prefix_caching = true;
        self
    }

    /// Preempt by swapping, with this many host blocks.
    fn swap(mut self, host_blocks: usize) -> Self {
        self.config.preemption = Preemption::Swap;
        self.config.swap_blocks = host_blocks;
        self
    }

    fn max_prefill_chunk(mut self, tokens: usize) -> Self {
        self.config.max_prefill_chunk = tokens;
        self
    }

    fn batching(mut self, batching: Batching) -> Self {
        self.config.batching = batching;
        self
    }

    fn batch_timeout(mut self, timeout: Duration) -> Self {
        self.config.batch_timeout = timeout;
        self
    }

    fn build(self) -> Scheduler {
        Scheduler::new(self.config)
    }

    /// The scheduler with requests 0, 1, ... queued, of these prompt lengths.
    fn with_prompts(self, lens: &[usize]) -> Scheduler {
        let mut s = self.build();
        for (id, &len) in lens.iter().enumerate() {
            s.add(seq(id as u64, len));
        }
        s
    }
}

/// A prompt of `len` distinct tokens: 100, 101, ...
fn prompt(len: usize) -> Vec<u32> {
    (0..len as u32).map(|t| t + 100).collect()
}

fn seq(id: u64, prompt_len: usize) -> Sequence {
    seq_of(id, prompt(prompt_len))
}

fn seq_of(id: u64, prompt: Vec<u32>) -> Sequence {
    Sequence::new(id, prompt, Default::default())
}

fn tokens_of(prefix: &[u32], rest: &[u32]) -> Vec<u32> {
    prefix.iter().chain(rest).copied().collect()
}

/// Plays the shard: every request that samples gets token `1000 + id`.
fn step(s: &mut Scheduler) -> Schedule {
    step_at(s, Instant::now())
}

fn step_at(s: &mut Scheduler, now: Instant) -> Schedule {
    let out = s.schedule_at(now);
    for &id in &out.samples {
        assert!(s.append_tokens(id, &[1000 + id as u32]));
    }
    s.check_invariants().unwrap();
    out
}

/// (request, tokens computed) of the step: joined ones first, then continuing ones.
fn computes(out: &Schedule) -> Vec<(u64, u32)> {
    let step = out.step.as_ref().unwrap();
    let mut v: Vec<(u64, u32)> = step.joined.iter().map(|r| (r.id, r.num_compute)).collect();
    v.extend(step.continuing.iter().map(|r| (r.id, r.num_compute)));
    v
}

#[test]
fn budgets_cap_tokens_and_batch_size() {
    let mut s = setup(10, 3, 100).with_prompts(&[3; 5]);
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
    let mut s = setup(8, 8, 100).with_prompts(&[2, 2]);
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
    let mut s = setup(64, 8, 4).with_prompts(&[4, 4]);
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
    let mut s = setup(64, 8, 2).with_prompts(&[7]);
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
    let mut s = setup(64, 8, 10).with_prompts(&[5, 5]);
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
fn a_shared_prefix_is_computed_once_even_when_requests_arrive_together() {
    let system: Vec<u32> = (0..10).collect(); // two full blocks + 2 tokens
    let mut s = setup(64, 8, 100).prefix_caching().build();
    s.add(seq_of(0, tokens_of(&system, &[50, 51])));
    s.add(seq_of(1, tokens_of(&system, &[60])));
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
    let mut s = setup(64, 8, 100).build();
    s.add(seq_of(0, tokens_of(&system, &[50, 51])));
    s.add(seq_of(1, tokens_of(&system, &[60])));
    assert_eq!(computes(&step(&mut s)), vec![(0, 12), (1, 11)]);
}

#[test]
fn a_request_asking_for_prompt_logprobs_skips_the_prefix_cache() {
    let system: Vec<u32> = (0..10).collect();
    let mut s = setup(64, 8, 100).prefix_caching().build();
    s.add(seq_of(0, tokens_of(&system, &[50])));
    step(&mut s);
    s.finish(0);
    let mut seq = seq_of(1, tokens_of(&system, &[60]));
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
    let mut s = setup(64, 8, 100).prefix_caching().with_prompts(&[3]);
    for _ in 0..6 {
        step(&mut s); // 3 prompt tokens, then 1000, 1000, ... decoded
    }
    let running = s.get(0).unwrap().token_ids.clone();
    assert!(s.get(0).unwrap().num_computed >= 8);
    // A later prompt equal to request 0's first 8 tokens (prompt + generated) + 1.
    s.add(seq_of(1, tokens_of(&running[..8], &[7])));
    let out = step(&mut s);
    let joined = &out.step.as_ref().unwrap().joined[0];
    assert_eq!((joined.num_cached, joined.num_compute), (8, 1));
    assert_eq!(joined.block_table[..2], s.blocks().table(0)[..2]);
}

#[test]
fn max_prefill_chunk_splits_a_long_prompt_while_decodes_run_every_step() {
    let mut s = setup(64, 8, 100).max_prefill_chunk(8).with_prompts(&[2, 2]);
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
    let mut s = setup(64, 8, 4).swap(8).with_prompts(&[4, 4]);
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
    let mut s = setup(64, 8, 4).swap(1).with_prompts(&[4, 4]);
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
    let mut s = setup(64, 8, 20).prefix_caching().with_prompts(&[6]);
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
    let mut s = setup(64, 8, 100)
        .batching(Batching::None)
        .with_prompts(&[2, 2]);
    assert_eq!(computes(&step(&mut s)), vec![(0, 2)]);
    assert_eq!(computes(&step(&mut s)), vec![(0, 1)]);
    s.finish(0);
    assert_eq!(computes(&step(&mut s)), vec![(1, 2)]);

    // static: a batch of what waits; later arrivals wait until every member is done.
    let mut s = setup(64, 2, 100)
        .batching(Batching::Static)
        .with_prompts(&[2, 2, 2]);
    assert_eq!(computes(&step(&mut s)), vec![(0, 2), (1, 2)]);
    s.finish(0);
    assert_eq!(computes(&step(&mut s)), vec![(1, 1)]);
    s.finish(1);
    assert_eq!(computes(&step(&mut s)), vec![(2, 2)]);

    // dynamic: waits for a full batch or the timeout.
    let mut s = setup(64, 3, 100)
        .batching(Batching::Dynamic)
        .batch_timeout(Duration::from_millis(10))
        .build();
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

// -- randomized workloads ----------------------------------------------------------------

/// The requests of a random workload: each finishes once it has generated its target.
#[derive(Default)]
struct Workload {
    targets: HashMap<u64, usize>,
    next_id: u64,
    done: u64,
}

impl Workload {
    /// Queues the next request, to generate `target` tokens.
    fn arrive(&mut self, s: &mut Scheduler, prompt: Vec<u32>, target: usize) {
        self.targets.insert(self.next_id, target);
        s.add(seq_of(self.next_id, prompt));
        self.next_id += 1;
    }

    /// Checks a step's budgets, then finishes the requests it sampled that reached their
    /// target.
    fn after_step(&mut self, s: &mut Scheduler, out: Schedule) {
        if let Some(req) = &out.step {
            assert!(out.num_tokens <= s.config.max_batch_tokens);
            assert!(req.joined.len() + req.continuing.len() <= s.config.max_batch_size);
        }
        assert!(out.failed.is_empty());
        for id in out.samples {
            if s.get(id).unwrap().num_generated() >= self.targets[&id] {
                s.finish(id);
                self.done += 1;
            }
        }
        s.check_invariants().unwrap();
    }
}

#[test]
fn random_workloads_keep_invariants_and_every_request_finishes() {
    let mut rng = StdRng::seed_from_u64(3);
    for _ in 0..30 {
        let mut s = setup(
            rng.random_range(1..40),
            rng.random_range(1..6),
            rng.random_range(8..30),
        )
        .build();
        let mut work = Workload::default();
        for _ in 0..400 {
            if work.next_id < 20 && rng.random_bool(0.3) {
                let prompt_len = rng.random_range(1..12);
                let target = rng.random_range(1..8);
                work.arrive(&mut s, prompt(prompt_len), target);
            }
            let out = step(&mut s);
            work.after_step(&mut s, out);
        }
        assert_eq!(work.done, work.next_id, "every request should finish");
        assert_eq!(s.blocks().num_free(), s.blocks().num_blocks());
    }
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
        let mut speculating = HashMap::new();
        for c in &req.continuing {
            let r = self.reqs.get_mut(&c.id).unwrap();
            r.2.extend(&c.new_blocks);
            r.0.extend(&c.proposed_tokens);
            if !c.proposed_tokens.is_empty() {
                speculating.insert(c.id, accepted_of(req, c.id));
            }
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
            if let Some(&accepted) = speculating.get(&id) {
                // The proposals past the accepted ones are dropped, and so are their blocks.
                let proposed = n - 1;
                r.1 -= proposed - accepted;
                r.0.truncate(r.1);
                r.2.truncate(r.1.div_ceil(bs));
            }
            if r.1 == r.0.len() {
                r.0.push(1000 + id as u32);
            }
        }
    }
}

#[test]
fn random_workloads_under_every_policy_match_the_kv_model_and_finish() {
    let mut rng = StdRng::seed_from_u64(11);
    for round in 0..200 {
        let mut builder = setup(
            rng.random_range(1..40),
            rng.random_range(1..6),
            rng.random_range(8..30),
        );
        if rng.random_bool(0.7) {
            builder = builder.prefix_caching();
        }
        builder = builder.max_prefill_chunk(rng.random_range(0..6));
        if rng.random_bool(0.5) {
            builder = builder.swap(rng.random_range(0..40));
        }
        let c = builder
            .batching(
                [
                    Batching::Continuous,
                    Batching::Static,
                    Batching::None,
                    Batching::Dynamic,
                ][round % 4],
            )
            .batch_timeout(Duration::ZERO)
            .config;
        let mut s = Scheduler::new(c);
        let mut model = KvModel::default();
        let mut work = Workload::default();
        for _ in 0..600 {
            if work.next_id < 16 && rng.random_bool(0.3) {
                let len = rng.random_range(1..14);
                // Two-letter vocabulary: plenty of shared prefixes.
                let prompt = (0..len).map(|_| rng.random_range(0..2)).collect();
                let target = rng.random_range(1..8);
                work.arrive(&mut s, prompt, target);
            }
            let out = step(&mut s);
            if let Some(req) = &out.step {
                model.apply(req, BLOCK_SIZE);
            }
            work.after_step(&mut s, out);
        }
        assert_eq!(
            work.done, work.next_id,
            "every request should finish ({c:?})"
        );
        assert_eq!(s.blocks().num_used(), 0);
        assert_eq!(s.blocks().num_free(), s.blocks().num_blocks());
    }
}

/// One request with this prompt length and token limit, on a scheduler that is not
/// short of anything unless `num_blocks` says so.
fn limited(prompt_len: usize, max_new_tokens: usize, num_blocks: usize) -> Scheduler {
    let mut s = setup(64, 8, num_blocks).prefix_caching().build();
    let mut q = seq(0, prompt_len);
    q.max_new_tokens = max_new_tokens;
    s.add(q);
    s
}

/// What the batching loop does with asynchronous scheduling: send (mark the samples
/// pending), schedule the next step ahead and send it, then apply the first one's tokens.
fn send(s: &mut Scheduler, out: &Schedule) {
    s.expect_samples(&out.samples);
    s.check_invariants().unwrap();
}

fn apply(s: &mut Scheduler, out: &Schedule, token: u32) {
    for &id in &out.samples {
        s.append_tokens(id, &[token]);
    }
    s.check_invariants().unwrap();
}

#[test]
fn scheduled_ahead_a_request_decodes_its_pending_token_and_stops_at_its_limit() {
    let mut s = limited(3, 3, 100);
    let first = s.schedule();
    assert_eq!(computes(&first), vec![(0, 3)]);
    send(&mut s, &first);
    // The prompt's sample is pending: the next step decodes it without knowing it.
    let second = s.schedule_ahead();
    assert_eq!(computes(&second), vec![(0, 1)]);
    assert_eq!(second.samples, vec![0]);
    send(&mut s, &second);
    apply(&mut s, &first, 1000);
    let third = s.schedule_ahead();
    assert_eq!(computes(&third), vec![(0, 1)]);
    send(&mut s, &third);
    apply(&mut s, &second, 1001);
    // Two tokens known, the third (its last) pending: nothing more to compute.
    assert!(s.schedule_ahead().step.is_none());
    apply(&mut s, &third, 1002);
    assert_eq!(s.get(0).unwrap().token_ids[3..], [1000, 1001, 1002]);
    assert_eq!(s.get(0).unwrap().pending, 0);
}

#[test]
fn ahead_of_a_step_short_of_blocks_nothing_is_scheduled_so_the_next_step_preempts() {
    // Two 4-token prompts fill both blocks; each pending token needs a third block.
    let mut s = setup(64, 8, 2).with_prompts(&[4, 4]);
    let first = s.schedule();
    assert_eq!(first.samples, vec![0, 1]);
    send(&mut s, &first);
    s.add(seq(2, 1)); // would fit in a freed block, but running requests come first
    let ahead = s.schedule_ahead();
    assert!(ahead.step.is_none() && ahead.preempted.is_empty() && ahead.failed.is_empty());
    assert_eq!((s.num_running(), s.num_waiting()), (2, 1));
    // Once the tokens are known, the ordinary schedule preempts the latest arrival.
    apply(&mut s, &first, 1000);
    let next = s.schedule();
    assert_eq!(next.preempted, vec![1]);
    assert_eq!(computes(&next), vec![(0, 1)]);
}

#[test]
fn a_block_completed_by_a_pending_token_is_cached_once_the_token_is_known() {
    let mut s = limited(3, 10, 100);
    let first = s.schedule();
    send(&mut s, &first);
    let second = s.schedule_ahead(); // computes position 3, the pending token's
    send(&mut s, &second);
    let probe = vec![100, 101, 102, 1000, 7, 8];
    let m = s.blocks().match_prefix(&probe, chain_seed(""));
    assert!(
        m.blocks.is_empty() && !m.pending,
        "its content is not known yet"
    );
    apply(&mut s, &first, 1000);
    apply(&mut s, &second, 1001);
    // A prompt starting with that block's four tokens finds it.
    s.add(seq_of(1, probe));
    let out = s.schedule();
    assert_eq!(out.prefix_hits, 4);
    let joined = &out.step.as_ref().unwrap().joined[0];
    assert_eq!((joined.id, joined.num_cached), (1, 4));
}

// -- speculative decoding ---------------------------------------------------------------

/// One request past its prefill (prompt of `prompt_len`, its first token 1000 applied),
/// on a scheduler whose steps take proposals while they hold at most `max_step_tokens`.
fn decoding(prompt_len: usize, max_step_tokens: usize, num_blocks: usize) -> Scheduler {
    let mut config = setup(64, 8, num_blocks).prefix_caching().config;
    config.speculative_max_step_tokens = max_step_tokens;
    let mut s = Scheduler::new(config);
    s.add(seq(0, prompt_len));
    step(&mut s);
    s
}

fn proposed(out: &Schedule) -> Vec<(u64, Vec<u32>)> {
    let step = out.step.as_ref().unwrap();
    step.continuing
        .iter()
        .map(|c| (c.id, c.proposed_tokens.clone()))
        .collect()
}

#[test]
fn a_proposal_is_computed_with_the_decode_and_counts_once_verified() {
    let mut s = decoding(3, 16, 100);
    s.propose(0, Proposal::Tokens(vec![7, 8, 9]));
    let out = s.schedule();
    assert_eq!(computes(&out), vec![(0, 4)]);
    assert_eq!(proposed(&out), vec![(0, vec![7, 8, 9])]);
    assert_eq!((out.speculating, out.proposed_tokens), (1, 3));
    assert_eq!(out.samples, vec![0]);
    // The sampled token is computed; the proposals wait for the answer, in two blocks.
    let seq = s.get(0).unwrap();
    assert_eq!((seq.num_computed, seq.verifying), (4, 3));
    assert_eq!(s.blocks().table(0).len(), 2);
    s.check_invariants().unwrap();
    // Two accepted: the answer brings them and the model's own third token.
    s.verified(0, 2).unwrap();
    assert!(s.append_tokens(0, &[7, 8, 5]));
    let seq = s.get(0).unwrap();
    assert_eq!((seq.num_computed, seq.verifying), (6, 0));
    assert_eq!(seq.token_ids[3..], [1000, 7, 8, 5]);
    s.check_invariants().unwrap();
    // Unproposed, the next step decodes the one token known and not computed.
    assert_eq!(computes(&s.schedule()), vec![(0, 1)]);
}

#[test]
fn rejected_proposals_give_their_blocks_back_and_both_sides_cut_the_table() {
    // A 4-token prompt fills block 0; its token and three proposals take block 1 and 2.
    let mut s = decoding(7, 16, 100);
    s.propose(0, Proposal::Tokens(vec![7, 8, 9, 10]));
    let out = s.schedule();
    assert_eq!(computes(&out), vec![(0, 5)]);
    assert_eq!(s.blocks().table(0).len(), 3);
    let used = s.blocks().num_used();
    s.verified(0, 0).unwrap();
    s.append_tokens(0, &[5]);
    // Computed: 8 tokens = 2 blocks; the third held only a rejected proposal.
    assert_eq!(s.blocks().table(0).len(), 2);
    assert_eq!(s.blocks().num_used(), used - 1);
    s.check_invariants().unwrap();
    // The next step sends the request's next block afresh: the shard cut its table too.
    let next = s.schedule();
    let c = &next.step.as_ref().unwrap().continuing[0];
    assert_eq!((c.num_compute, c.new_blocks.len()), (1, 1));
    assert!(s.verified(0, 1).is_err(), "nothing was proposed");
}

#[test]
fn the_load_threshold_trims_proposals_oldest_first_and_counts_who_went_without() {
    let mut config = setup(64, 8, 100).config;
    config.speculative_max_step_tokens = 5;
    let mut s = Scheduler::new(config);
    for id in 0..3 {
        s.add(seq(id, 2));
    }
    step(&mut s);
    for id in 0..3 {
        s.propose(id, Proposal::Tokens(vec![7, 8, 9]));
    }
    let out = s.schedule();
    // Three decodes leave room for two proposals: the oldest takes both.
    assert_eq!(computes(&out), vec![(0, 3), (1, 1), (2, 1)]);
    assert_eq!(out.speculation_off, 2);
    // Off: no proposals at all.
    let mut config = setup(64, 8, 100).config;
    config.speculative_max_step_tokens = 0;
    let mut s = Scheduler::new(config);
    s.add(seq(0, 2));
    step(&mut s);
    s.propose(0, Proposal::Draft(3));
    assert_eq!(computes(&s.schedule()), vec![(0, 1)]);
}

#[test]
fn proposals_stop_at_the_token_limit_and_draft_counts_are_sent_as_such() {
    let mut s = decoding(3, 16, 100);
    s.running[0].max_new_tokens = 3; // one generated: two more, the last one sampled
    s.propose(0, Proposal::Draft(4));
    let out = s.schedule();
    assert_eq!(computes(&out), vec![(0, 2)]);
    let c = &out.step.as_ref().unwrap().continuing[0];
    assert_eq!((c.num_draft_tokens, c.proposed_tokens.len()), (1, 0));
    s.verified(0, 1).unwrap();
    s.append_tokens(0, &[7, 8]);
    assert_eq!(s.get(0).unwrap().num_generated(), 3);
    assert!(s.schedule().step.is_none(), "at its limit");
}

#[test]
fn a_block_full_of_unverified_proposals_is_cached_only_once_verified() {
    let mut s = decoding(3, 16, 100);
    // Position 3 is the sampled token; the proposals fill positions 4..8 (block 1).
    s.propose(0, Proposal::Tokens(vec![7, 8, 9, 10]));
    s.schedule();
    s.schedule_ahead(); // a later schedule marks the step's blocks ready
    let probe = vec![100, 101, 102, 1000, 7, 8, 9, 10, 1];
    let m = s.blocks().match_prefix(&probe, chain_seed(""));
    assert_eq!(m.blocks.len(), 1, "block 0 holds verified tokens only");
    s.verified(0, 4).unwrap();
    s.append_tokens(0, &[7, 8, 9, 10, 11]);
    s.schedule();
    let m = s.blocks().match_prefix(&probe, chain_seed(""));
    assert_eq!(m.blocks.len(), 2, "block 1 is verified now");
}

#[test]
fn preemption_drops_a_requests_proposal() {
    // Two 4-token prompts in 3 blocks: the next decode preempts the latest arrival.
    let mut config = setup(64, 8, 3).config;
    config.speculative_max_step_tokens = 16;
    let mut s = Scheduler::new(config);
    s.add(seq(0, 4));
    s.add(seq(1, 4));
    step(&mut s);
    s.propose(0, Proposal::Tokens(vec![7]));
    s.propose(1, Proposal::Tokens(vec![7]));
    let out = s.schedule();
    assert_eq!(out.preempted, vec![1]);
    assert_eq!(s.get(1).unwrap().proposal, Proposal::None);
    s.check_invariants().unwrap();
}

/// The KV model's view of speculative steps: every proposal equal to the stand-in
/// shard's token (`1000 + id`) is accepted, up to the first that is not.
fn accepted_of(req: &pb::StepRequest, id: u64) -> usize {
    let c = req.continuing.iter().find(|c| c.id == id).unwrap();
    c.proposed_tokens
        .iter()
        .take_while(|&&t| t == 1000 + id as u32)
        .count()
}

#[test]
fn random_workloads_with_proposals_match_the_kv_model_and_never_pass_limits() {
    let mut rng = StdRng::seed_from_u64(17);
    for round in 0..150 {
        let mut builder = setup(
            rng.random_range(4..40),
            rng.random_range(1..6),
            rng.random_range(8..30),
        );
        if rng.random_bool(0.7) {
            builder = builder.prefix_caching();
        }
        if rng.random_bool(0.5) {
            builder = builder.swap(rng.random_range(0..40));
        }
        let mut config = builder.config;
        config.speculative_max_step_tokens = rng.random_range(1..24);
        let mut s = Scheduler::new(config);
        let mut model = KvModel::default();
        let (mut next_id, mut done) = (0u64, 0u64);
        for _ in 0..600 {
            if next_id < 16 && rng.random_bool(0.3) {
                let len = rng.random_range(1..14);
                let prompt: Vec<u32> = (0..len).map(|_| rng.random_range(0..2)).collect();
                let mut q = seq_of(next_id, prompt);
                q.max_new_tokens = rng.random_range(1..12);
                s.add(q);
                next_id += 1;
            }
            let ids: Vec<u64> = s
                .running()
                .iter()
                .filter(|q| q.decodes_next())
                .map(|q| q.id)
                .collect();
            for id in ids {
                let k = rng.random_range(0..5);
                let tokens = (0..k)
                    .map(|_| {
                        if rng.random_bool(0.6) {
                            1000 + id as u32
                        } else {
                            7
                        }
                    })
                    .collect();
                s.propose(id, Proposal::Tokens(tokens));
            }
            let out = s.schedule();
            if let Some(req) = &out.step {
                model.apply(req, BLOCK_SIZE);
            }
            for &id in &out.samples {
                let accepted = match &out.step {
                    Some(req) if s.get(id).unwrap().verifying > 0 => accepted_of(req, id),
                    _ => 0,
                };
                if s.get(id).unwrap().verifying > 0 {
                    s.verified(id, accepted).unwrap();
                }
                s.append_tokens(id, &vec![1000 + id as u32; accepted + 1]);
                let q = s.get(id).unwrap();
                assert!(q.num_generated() <= q.max_new_tokens, "round {round}");
                if q.num_generated() == q.max_new_tokens {
                    s.finish(id);
                    done += 1;
                }
            }
            assert!(out.failed.is_empty());
            s.check_invariants().unwrap();
        }
        assert_eq!(done, next_id, "every request should finish (round {round})");
        assert_eq!(s.blocks().num_used(), 0);
    }
}

/// LoRA adapters in the pool.
mod adapters;
/// The scheduling policies: fair (Virtual Token Counter) and priority.
mod policies;
/// The batching loop's whole protocol at random.
mod random_loop;
