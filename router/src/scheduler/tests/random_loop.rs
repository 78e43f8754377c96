//! The batching loop's whole protocol at random, against one scheduler: arrivals with
//! and without adapters, adapter loads and unloads, cancellations, forks, forced tokens,
//! proposals and their verification, steps scheduled ahead, shard failures, on caches
//! small enough to preempt by recomputation and by swapping. The bookkeeping holds after
//! every step, and once arrivals stop every request ends and gives everything back.

use std::collections::{HashMap, HashSet};

use super::*;

/// A random configuration: small caches and budgets, every policy.
fn random_config(rng: &mut StdRng) -> SchedulerConfig {
    let block_size = [1, 2, 4, 8][rng.random_range(0..4)];
    let mut c = SchedulerConfig::new(
        rng.random_range(1..64),
        rng.random_range(1..9),
        rng.random_range(3..48),
        block_size,
    );
    if rng.random_bool(0.5) {
        c.max_prefill_chunk = rng.random_range(1..12);
    }
    if rng.random_bool(0.5) {
        c.preemption = Preemption::Swap;
        c.swap_blocks = rng.random_range(0..48);
    }
    c.prefix_caching = rng.random_bool(0.7);
    c.batching = [
        Batching::Continuous,
        Batching::Continuous,
        Batching::Dynamic,
        Batching::Static,
        Batching::None,
    ][rng.random_range(0..5)];
    c.batch_timeout = Duration::from_millis([0, 3, 40][rng.random_range(0..3)]);
    c.speculative_max_step_tokens = [0, 0, 4, 8, 32][rng.random_range(0..5)];
    c.max_adapters_per_batch = rng.random_range(1..4);
    c
}

/// Plays the batching loop for `steps` iterations with arrivals, then without until the
/// scheduler has no work; returns the steps sent.
fn play(seed: u64, steps: usize) -> usize {
    let mut rng = StdRng::seed_from_u64(seed);
    let config = random_config(&mut rng);
    let mut s = Scheduler::new(config);
    let adapters = ["", "", "a", "b", "c"];
    let adapter_size: Vec<usize> = (0..adapters.len())
        .map(|_| rng.random_range(1..5))
        .collect();
    let vocab = rng.random_range(2..6);
    let base = Instant::now();
    let mut targets: HashMap<u64, usize> = HashMap::new();
    let mut next_id = 0u64;
    let mut in_flight: Option<Schedule> = None;
    let mut sent = 0;
    let check = |s: &Scheduler, t: usize| {
        s.check_invariants()
            .unwrap_or_else(|e| panic!("seed {seed} step {t}: {e}"))
    };
    for t in 0.. {
        let arriving = t < steps;
        if !arriving && !s.has_work() && in_flight.is_none() {
            break;
        }
        assert!(t < steps + 20_000, "seed {seed}: the requests never ended");
        let now = base + Duration::from_millis(t as u64);
        if arriving && rng.random_bool(0.3) && s.num_running() + s.num_waiting() < 24 {
            let a = rng.random_range(0..adapters.len());
            let len = rng.random_range(1..48);
            let mut q = seq_of(
                next_id,
                (0..len).map(|_| rng.random_range(0..vocab)).collect(),
            );
            q.arrived = now;
            q.adapter_id = adapters[a].into();
            if rng.random_bool(0.5) {
                q.max_new_tokens = rng.random_range(1..40);
            }
            if !q.adapter_id.is_empty() && rng.random_bool(0.5) {
                // Now and then an adapter too big for the cache: refused.
                let scale = if rng.random_bool(0.05) { 20 } else { 1 };
                q.adapter_blocks = Some(adapter_size[a] * scale);
            }
            q.prompt_logprobs = rng.random_bool(0.1);
            targets.insert(next_id, rng.random_range(1..40));
            next_id += 1;
            s.add(q);
        }
        for name in s.adapters_awaited() {
            if rng.random_bool(0.4) {
                let a = adapters.iter().position(|n| *n == name).unwrap();
                s.adapter_loaded(&name, adapter_size[a]);
            }
        }
        if rng.random_bool(0.01) {
            let doomed: HashSet<String> = ["a", "b", "c"]
                .into_iter()
                .filter(|_| rng.random_bool(0.3))
                .map(String::from)
                .collect();
            s.set_doomed(doomed);
        }
        if next_id > 0 && rng.random_bool(0.08) {
            s.finish(rng.random_range(0..next_id)); // cancelled
        }
        if rng.random_bool(0.002) {
            s.reset(); // a shard failed
            in_flight = None;
        }
        if in_flight.is_none() {
            for id in s.running().iter().map(|q| q.id).collect::<Vec<_>>() {
                if s.get(id).unwrap().decodes_next() && rng.random_bool(0.7) {
                    let k = rng.random_range(0..6);
                    let proposal = match rng.random_range(0..3) {
                        0 => Proposal::None,
                        1 => Proposal::Tokens((0..k).map(|_| rng.random_range(0..vocab)).collect()),
                        _ => Proposal::Draft(k),
                    };
                    s.propose(id, proposal);
                }
            }
            let out = s.schedule_at(now);
            check(&s, t);
            if out.step.is_some() {
                s.expect_samples(&out.samples);
                sent += 1;
                in_flight = Some(out);
            }
        }
        let Some(step) = in_flight.take() else {
            continue;
        };
        let mut next = None;
        if step.speculating == 0 && rng.random_bool(0.4) {
            let out = s.schedule_ahead();
            check(&s, t);
            if out.step.is_some() {
                s.expect_samples(&out.samples);
                sent += 1;
                next = Some(out);
            }
        }
        for id in step.samples {
            let Some(verifying) = s.get(id).map(|q| q.verifying) else {
                continue; // cancelled meanwhile
            };
            let accepted = rng.random_range(0..=verifying);
            s.verified(id, accepted).unwrap();
            let tokens: Vec<u32> = (0..=accepted).map(|_| rng.random_range(0..vocab)).collect();
            assert!(s.append_tokens(id, &tokens));
            let q = s.get(id).unwrap();
            let (generated, pending, limit) = (q.num_generated(), q.pending, q.max_new_tokens);
            assert!(generated <= limit, "past its token limit");
            if generated >= targets[&id].min(limit) {
                s.finish(id);
                continue;
            }
            // A grammar forces tokens, leaving room for the sample after them.
            let room = limit.saturating_sub(generated + 1).min(3);
            if room > 0 && rng.random_bool(0.05) {
                let forced: Vec<u32> = (0..rng.random_range(1..=room))
                    .map(|_| rng.random_range(0..vocab))
                    .collect();
                s.append_forced(id, &forced);
            }
            if next.is_none() && pending == 0 && generated == 1 && rng.random_bool(0.15) {
                targets.insert(next_id, rng.random_range(1..40));
                if s.fork(id, next_id, rng.random()) {
                    next_id += 1;
                }
            }
        }
        in_flight = next;
        check(&s, t);
    }
    assert_eq!((s.num_running(), s.num_waiting()), (0, 0));
    let want = match config.preemption {
        Preemption::Swap => config.swap_blocks,
        Preemption::Recompute => 0,
    };
    assert_eq!(s.num_host_free(), want, "seed {seed}: host blocks held");
    // Cached prefixes and idle adapters count as free: they are evicted on demand.
    assert_eq!(
        s.blocks().num_free(),
        s.blocks().num_blocks(),
        "seed {seed}: KV blocks held"
    );
    sent
}

#[test]
fn random_loops_keep_the_bookkeeping_and_give_everything_back() {
    let sent: usize = (0..40).map(|seed| play(seed, 1500)).sum();
    assert!(sent > 10_000, "only {sent} steps sent");
}
