//! LoRA adapters paged into the KV pool: page-in with the first request, admission that
//! counts the adapter's blocks, references held by running requests, eviction by last use
//! (against cached prefix blocks too), the batch's adapter limit, preemption, unloading.

use std::collections::{HashMap, HashSet};

use super::*;

/// Request `id` with a prompt of `len` tokens and adapter `name`, whose weights take
/// `blocks` blocks (its host load done).
fn lora_seq(id: u64, len: usize, name: &str, blocks: usize) -> Sequence {
    let mut s = seq(id, len);
    s.adapter_id = name.into();
    s.adapter_blocks = Some(blocks);
    s
}

fn step_of(out: &Schedule) -> &pb::StepRequest {
    out.step.as_ref().expect("a step")
}

fn paged_in(out: &Schedule) -> Vec<(String, usize)> {
    step_of(out)
        .adapters_in
        .iter()
        .map(|a| (a.name.clone(), a.blocks.len()))
        .collect()
}

fn paged_out(out: &Schedule) -> Vec<String> {
    step_of(out).adapters_out.clone()
}

fn joined(out: &Schedule) -> Vec<u64> {
    step_of(out).joined.iter().map(|j| j.id).collect()
}

#[test]
fn an_adapter_is_paged_in_with_its_first_request_into_blocks_no_request_holds() {
    let mut s = setup(64, 8, 20).build();
    s.add(lora_seq(0, 8, "sql", 6));
    s.add(lora_seq(1, 8, "sql", 6));
    s.add(seq(2, 8));
    let out = step(&mut s);
    assert_eq!(paged_in(&out), vec![("sql".to_string(), 6)]);
    let sent = step_of(&out);
    let adapters: Vec<&str> = sent.joined.iter().map(|j| j.adapter_id.as_str()).collect();
    assert_eq!(adapters, ["sql", "sql", ""]);
    // 6 adapter blocks + 3 requests x 2 KV blocks, all distinct.
    assert_eq!(s.blocks().num_used(), 6 + 3 * 2);
    let pages: HashSet<u32> = sent.adapters_in[0].blocks.iter().copied().collect();
    for j in &sent.joined {
        assert!(j.block_table.iter().all(|b| !pages.contains(b)), "{j:?}");
    }
    assert_eq!(s.blocks().adapter_users("sql"), Some(2));
    assert_eq!(s.blocks().num_adapter_blocks(), 6);
    // Resident: the next step pages nothing in.
    let out = step(&mut s);
    assert!(paged_in(&out).is_empty());
}

#[test]
fn admission_counts_the_adapters_blocks_beside_the_kv_blocks() {
    // 10 blocks: a base request holds 4, so 6 are free: the adapter (5) and its request's
    // KV (2) do not fit, and nothing behind it jumps the line for blocks.
    let mut s = setup(64, 8, 10).build();
    s.add(seq(0, 16));
    step(&mut s);
    s.add(lora_seq(1, 8, "sql", 5));
    s.add(seq(2, 4));
    let out = step(&mut s);
    assert_eq!(computes(&out), vec![(0, 1)]);
    assert_eq!(s.num_waiting(), 2);
    s.finish(0);
    let out = step(&mut s);
    assert_eq!(joined(&out), vec![1, 2]);
    assert_eq!(paged_in(&out), vec![("sql".to_string(), 5)]);
    assert_eq!(s.blocks().num_used(), 5 + 2 + 1);
}

#[test]
fn a_request_waiting_for_its_adapters_load_is_passed_over_and_keeps_its_place() {
    let mut s = setup(64, 8, 40).build();
    let mut loading = seq(0, 4);
    loading.adapter_id = "slow".into();
    s.add(loading);
    s.add(seq(1, 4));
    let out = step(&mut s);
    assert_eq!(joined(&out), vec![1]);
    assert_eq!(s.adapters_awaited(), vec!["slow".to_string()]);
    assert_eq!(s.waiting_for_adapter("slow"), vec![0]);
    s.add(seq(2, 4));
    s.add(lora_seq(3, 4, "fast", 2));
    s.adapter_loaded("slow", 3);
    assert!(s.adapters_awaited().is_empty());
    // Loaded: it joins ahead of the later arrivals.
    let out = step(&mut s);
    assert_eq!(joined(&out), vec![0, 2, 3]);
    assert_eq!(
        paged_in(&out),
        vec![("slow".to_string(), 3), ("fast".to_string(), 2)]
    );
}

#[test]
fn running_requests_hold_their_adapter_and_an_idle_one_stays_resident_and_evictable() {
    let mut s = setup(64, 8, 20).build();
    s.add(lora_seq(0, 4, "sql", 4));
    s.add(lora_seq(1, 4, "sql", 4));
    step(&mut s);
    s.finish(0);
    assert_eq!(s.blocks().adapter_users("sql"), Some(1));
    s.finish(1);
    // Nobody uses it: resident (its blocks still held) but counted free.
    assert_eq!(s.blocks().adapter_users("sql"), Some(0));
    assert_eq!((s.blocks().num_used(), s.blocks().num_free()), (4, 20));
    s.check_invariants().unwrap();
    // A new request takes it back without paging it in.
    s.add(lora_seq(2, 4, "sql", 4));
    let out = step(&mut s);
    assert!(paged_in(&out).is_empty() && paged_out(&out).is_empty());
    assert_eq!(s.blocks().adapter_users("sql"), Some(1));
}

#[test]
fn an_idle_adapter_is_evicted_when_blocks_are_needed_and_leaves_with_adapters_out() {
    let mut s = setup(64, 8, 10).build();
    s.add(lora_seq(0, 4, "a", 6));
    step(&mut s);
    s.finish(0);
    // "b" (6 blocks) + 1 KV block need 7 of 10: "a"'s 6 idle blocks must go.
    s.add(lora_seq(1, 4, "b", 6));
    let out = step(&mut s);
    assert_eq!(paged_out(&out), vec!["a".to_string()]);
    assert_eq!(paged_in(&out), vec![("b".to_string(), 6)]);
    assert_eq!(s.blocks().adapter_users("a"), None);
    assert_eq!(s.blocks().num_adapter_blocks(), 6);
    assert_eq!(s.blocks().num_used(), 7);
}

#[test]
fn cached_prefix_blocks_and_idle_adapters_are_evicted_oldest_first() {
    // Each case: 12 blocks; a base request's 2 full prompt blocks end up cached and an
    // adapter's 4 blocks idle, in one order or the other; then a request needs 7 of the 8
    // free blocks + all of one of them.
    for prefix_first in [true, false] {
        let mut s = setup(64, 8, 12).prefix_caching().build();
        s.add(seq(0, 8));
        s.add(lora_seq(1, 3, "a", 4));
        step(&mut s);
        step(&mut s); // the prompt's blocks are ready (hit-able) now
        let (older, newer) = if prefix_first { (0, 1) } else { (1, 0) };
        s.finish(older);
        s.finish(newer);
        assert_eq!(s.blocks().num_cached(), 2);
        assert_eq!(s.blocks().adapter_users("a"), Some(0));
        // A base request of 28 tokens: 7 blocks, 6 free: one eviction frees enough.
        let mut other = seq_of(2, (500..528).collect());
        other.max_new_tokens = 1;
        s.add(other);
        let out = step(&mut s);
        assert_eq!(joined(&out), vec![2]);
        if prefix_first {
            assert!(paged_out(&out).is_empty(), "the older prefix goes first");
            assert_eq!(s.blocks().adapter_users("a"), Some(0));
            assert_eq!(s.blocks().num_cached(), 1);
        } else {
            assert_eq!(paged_out(&out), vec!["a".to_string()]);
            assert_eq!(s.blocks().num_cached(), 2);
        }
    }
}

#[test]
fn a_batch_holds_at_most_max_adapters_per_batch_and_requests_for_running_ones_go_ahead() {
    let mut config = SchedulerConfig::new(64, 8, 60, BLOCK_SIZE);
    config.max_adapters_per_batch = 2;
    let mut s = Scheduler::new(config);
    s.add(lora_seq(0, 4, "a", 2));
    s.add(lora_seq(1, 4, "b", 2));
    s.add(lora_seq(2, 4, "c", 2));
    s.add(lora_seq(3, 4, "a", 2));
    s.add(seq(4, 4));
    let out = step(&mut s);
    assert_eq!(joined(&out), vec![0, 1, 3, 4]);
    assert_eq!(s.blocks().active_adapters(), 2);
    assert_eq!(s.waiting().front().unwrap().id, 2);
    // "c" joins once "b" has no running request.
    s.finish(1);
    let out = step(&mut s);
    assert_eq!(joined(&out), vec![2]);
    assert_eq!(paged_in(&out), vec![("c".to_string(), 2)]);
}

#[test]
fn preemption_releases_the_adapter_and_the_request_takes_it_again_when_it_resumes() {
    for swap in [false, true] {
        // 9 blocks: adapter "a" (3) + two requests of 3 KV blocks grow into the last ones.
        let mut b = setup(64, 8, 9);
        if swap {
            b = b.swap(16);
        }
        let mut s = b.build();
        s.add(lora_seq(0, 11, "a", 3));
        s.add(lora_seq(1, 11, "a", 3));
        step(&mut s);
        assert_eq!(s.blocks().adapter_users("a"), Some(2));
        // Decoding until someone must give its blocks back.
        let mut preempted = None;
        for _ in 0..8 {
            let out = step(&mut s);
            if let Some(&id) = out.preempted.first().or(out.swapped_out.first()) {
                preempted = Some(id);
                break;
            }
        }
        assert_eq!(preempted, Some(1), "swap: {swap}");
        assert_eq!(s.blocks().adapter_users("a"), Some(1));
        s.finish(0);
        let out = step(&mut s);
        assert_eq!(joined(&out), vec![1]);
        assert_eq!(step_of(&out).joined[0].adapter_id, "a");
        assert_eq!(s.blocks().adapter_users("a"), Some(1));
        assert_eq!(step_of(&out).swap_in.is_empty(), !swap);
    }
}

#[test]
fn a_request_that_cannot_fit_with_its_adapter_even_alone_is_refused() {
    let mut s = setup(64, 8, 10).build();
    let mut big = lora_seq(0, 8, "huge", 9);
    big.max_new_tokens = 4; // 8 + 3 tokens of KV: 3 blocks, + 9
    s.add(big);
    s.add(seq(1, 4));
    let out = step(&mut s);
    assert_eq!(out.refused.len(), 1);
    let (id, why) = &out.refused[0];
    assert_eq!(*id, 0);
    assert!(
        why.contains("\"huge\" takes 9 KV blocks") && why.contains("holds 10"),
        "{why}"
    );
    assert_eq!(joined(&out), vec![1]);
    assert_eq!(s.blocks().num_adapter_blocks(), 0);
}

#[test]
fn an_adapter_being_unloaded_leaves_the_pool_with_its_last_request() {
    let mut s = setup(64, 8, 20).build();
    s.add(lora_seq(0, 4, "a", 3));
    s.add(lora_seq(1, 4, "b", 3));
    step(&mut s);
    s.finish(1); // "b" idle
    s.set_doomed(["a".to_string(), "b".to_string()].into());
    assert_eq!(s.blocks().adapter_users("b"), None, "idle: evicted at once");
    let out = step(&mut s);
    assert_eq!(paged_out(&out), vec!["b".to_string()]);
    // "a" runs until its request ends, then leaves, even with nothing else to run.
    assert_eq!(s.blocks().adapter_users("a"), Some(1));
    s.finish(0);
    assert!(s.has_work());
    let out = step(&mut s);
    assert_eq!(paged_out(&out), vec!["a".to_string()]);
    assert!(computes(&out).is_empty());
    assert_eq!(s.blocks().num_used(), 0);
    assert!(!s.has_work());
}

#[test]
fn a_reset_forgets_the_resident_adapters_with_the_requests() {
    let mut s = setup(64, 8, 20).build();
    s.add(lora_seq(0, 4, "a", 3));
    step(&mut s);
    s.finish(0);
    s.add(lora_seq(1, 4, "b", 3));
    step(&mut s);
    s.reset();
    s.check_invariants().unwrap();
    assert_eq!(
        (s.blocks().num_used(), s.blocks().num_adapter_blocks()),
        (0, 0)
    );
    // Paged in again by the next session's first request.
    s.add(lora_seq(2, 4, "a", 3));
    let out = step(&mut s);
    assert_eq!(paged_in(&out), vec![("a".to_string(), 3)]);
    assert!(paged_out(&out).is_empty());
}

/// The adapter bookkeeping a shard keeps from the steps: every joined request's adapter
/// is paged in, and no adapter block is in a request's table.
#[derive(Default)]
struct PagedModel {
    paged: HashMap<String, Vec<u32>>,
    tables: HashMap<u64, Vec<u32>>,
}

impl PagedModel {
    fn apply(&mut self, step: &pb::StepRequest) {
        for id in &step.removed {
            self.tables.remove(id);
        }
        for name in &step.adapters_out {
            assert!(self.paged.remove(name).is_some(), "{name} out but not in");
        }
        for a in &step.adapters_in {
            assert!(self
                .paged
                .insert(a.name.clone(), a.blocks.clone())
                .is_none());
        }
        for j in &step.joined {
            if !j.adapter_id.is_empty() {
                assert!(
                    self.paged.contains_key(&j.adapter_id),
                    "{} not paged",
                    j.adapter_id
                );
            }
            self.tables.insert(j.id, j.block_table.clone());
        }
        for c in &step.continuing {
            self.tables
                .get_mut(&c.id)
                .expect("a continuing request joined")
                .extend(&c.new_blocks);
        }
        let pages: HashSet<u32> = self.paged.values().flatten().copied().collect();
        for (id, table) in &self.tables {
            assert!(
                table.iter().all(|b| !pages.contains(b)),
                "request {id} holds an adapter block"
            );
        }
    }
}

#[test]
fn random_workloads_over_many_adapters_keep_the_pool_consistent_and_give_every_block_back() {
    let mut rng = StdRng::seed_from_u64(11);
    let mut evictions = 0;
    for round in 0..30 {
        let mut b = setup(48, 6, rng.random_range(24..48));
        if round % 2 == 0 {
            b = b.prefix_caching();
        }
        if round % 3 == 0 {
            b = b.swap(64);
        }
        b.config.max_adapters_per_batch = rng.random_range(1..4);
        let mut s = b.build();
        let names: Vec<String> = (0..8).map(|i| format!("lora-{i}")).collect();
        let sizes: Vec<usize> = (0..8).map(|_| rng.random_range(1..6)).collect();
        let mut model = PagedModel::default();
        let mut next = 0u64;
        for _ in 0..300 {
            if rng.random_range(0..3) == 0 {
                let len = rng.random_range(1..12);
                let mut q = seq_of(next, (0..len as u32).map(|t| t % 3).collect());
                q.max_new_tokens = rng.random_range(1..8);
                if rng.random_range(0..4) > 0 {
                    let a = rng.random_range(0..names.len());
                    q.adapter_id = names[a].clone();
                    q.adapter_blocks = Some(sizes[a]);
                }
                s.add(q);
                next += 1;
            }
            let out = step(&mut s);
            if let Some(step) = &out.step {
                evictions += step.adapters_out.len();
                model.apply(step);
            }
            let done: Vec<u64> = s
                .running()
                .iter()
                .filter(|q| q.num_generated() >= q.max_new_tokens)
                .map(|q| q.id)
                .collect();
            for id in done {
                s.finish(id);
            }
            for (id, _) in &out.refused {
                assert!(s.get(*id).is_none());
            }
        }
        // Drain: everything finishes, then no adapter has a user.
        for _ in 0..500 {
            if s.num_running() + s.num_waiting() == 0 {
                break;
            }
            let out = step(&mut s);
            if let Some(step) = &out.step {
                model.apply(step);
            }
            let done: Vec<u64> = s
                .running()
                .iter()
                .filter(|q| q.num_generated() >= q.max_new_tokens)
                .map(|q| q.id)
                .collect();
            for id in done {
                s.finish(id);
            }
        }
        assert_eq!(s.num_running() + s.num_waiting(), 0, "round {round}");
        assert!(s.blocks().resident_adapters().all(|(_, users)| users == 0));
        assert_eq!(s.blocks().num_adapter_blocks_in_use(), 0, "round {round}");
        // Unloading every adapter gives every block back.
        s.set_doomed(names.iter().cloned().collect());
        s.check_invariants().unwrap();
        assert_eq!(s.blocks().num_adapter_blocks(), 0);
        assert_eq!(s.blocks().num_used(), 0);
        assert_eq!(s.blocks().num_free(), s.config().num_blocks);
    }
    assert!(evictions > 0);
}
