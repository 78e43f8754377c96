//! The scheduling policies against the properties the Virtual Token Counter paper proves
//! (a bounded service gap between backlogged tenants, no credit for idleness, service in
//! proportion to weights) and priority scheduling's (aging bounds the wait; preemption
//! takes the worst-ranked request).

use std::collections::HashMap;

use super::*;
use crate::scheduler::vtc::{GENERATED_TOKEN_COST, PROMPT_TOKEN_COST};

/// Request `id` of `tenant` (weight `weight`): a prompt of `len` tokens, `max_new` tokens.
fn tenant_seq(id: u64, len: usize, max_new: usize, tenant: &str, weight: f64) -> Sequence {
    let mut s = seq(id, len);
    s.max_new_tokens = max_new;
    s.tenant = tenant.into();
    s.weight = weight;
    s
}

fn with_policy(mut setup: Setup, policy: SchedulingPolicy) -> Scheduler {
    setup.config.policy = policy;
    setup.build()
}

/// Service each tenant has received, counted from the requests themselves (not from the
/// scheduler's counters): computed prompt tokens and generated tokens, weighted as the
/// policy weighs them, divided by the tenant's weight.
#[derive(Default)]
struct Service {
    finished: HashMap<String, f64>,
}

impl Service {
    fn of_seq(seq: &Sequence) -> f64 {
        let prompt = seq.num_computed.min(seq.prompt_len) as f64;
        let generated = seq.num_generated() as f64;
        (PROMPT_TOKEN_COST * prompt + GENERATED_TOKEN_COST * generated) / seq.weight
    }

    fn of(&self, s: &Scheduler, tenant: &str) -> f64 {
        let live: f64 = s
            .running()
            .iter()
            .chain(s.waiting().iter())
            .filter(|q| &*q.tenant == tenant)
            .map(Self::of_seq)
            .sum();
        live + self.finished.get(tenant).copied().unwrap_or(0.0)
    }

    /// Retires the requests that generated all their tokens.
    fn retire_done(&mut self, s: &mut Scheduler) {
        let done: Vec<u64> = s
            .running()
            .iter()
            .filter(|q| q.num_generated() >= q.max_new_tokens)
            .map(|q| q.id)
            .collect();
        for id in done {
            let seq = s.finish(id).unwrap();
            *self.finished.entry(seq.tenant.to_string()).or_default() += Self::of_seq(&seq);
        }
    }
}

/// Keeps `tenant` backlogged: tops its waiting requests up to `depth`.
fn keep_backlogged(s: &mut Scheduler, next_id: &mut u64, tenant: &str, weight: f64, depth: usize) {
    let waiting = s.waiting().iter().filter(|q| &*q.tenant == tenant).count();
    for _ in waiting..depth {
        s.add(tenant_seq(*next_id, 8, 8, tenant, weight));
        *next_id += 1;
    }
}

/// Two tenants kept backlogged for `steps` steps: a with 40 requests waiting at any time,
/// b with one; the largest gap between their services, in the first and in the second
/// half of the run.
fn service_gaps(policy: SchedulingPolicy, steps: usize) -> (f64, f64) {
    let mut s = with_policy(setup(32, 4, 64), policy);
    let (mut service, mut next_id) = (Service::default(), 0);
    keep_backlogged(&mut s, &mut next_id, "a", 1.0, 40);
    let mut gaps = (0.0f64, 0.0f64);
    for n in 0..steps {
        keep_backlogged(&mut s, &mut next_id, "a", 1.0, 40);
        keep_backlogged(&mut s, &mut next_id, "b", 1.0, 1);
        step(&mut s);
        service.retire_done(&mut s);
        let gap = (service.of(&s, "a") - service.of(&s, "b")).abs();
        if n < steps / 2 {
            gaps.0 = gaps.0.max(gap);
        } else {
            gaps.1 = gaps.1.max(gap);
        }
    }
    (gaps.0, gaps.1)
}

#[test]
fn fair_keeps_the_service_gap_of_two_backlogged_tenants_bounded_while_fcfs_lets_it_grow() {
    // The paper's bound: about twice the cost of the batch a step can hold (4 requests of
    // 8 prompt and 8 generated tokens here), whatever the run's length.
    let bound = 2.0 * 4.0 * (8.0 * PROMPT_TOKEN_COST + 8.0 * GENERATED_TOKEN_COST);
    let (early, late) = service_gaps(SchedulingPolicy::Fair, 600);
    assert!(
        early <= bound && late <= bound,
        "gaps {early} and {late} past {bound}"
    );
    let (early, late) = service_gaps(SchedulingPolicy::Fcfs, 600);
    assert!(
        late > early && late > 4.0 * bound,
        "fcfs gaps {early}, {late}"
    );
}

#[test]
fn fair_divides_service_in_proportion_to_the_tenants_weights() {
    let mut s = with_policy(setup(32, 4, 64), SchedulingPolicy::Fair);
    let (mut service, mut next_id) = (Service::default(), 0);
    for _ in 0..800 {
        keep_backlogged(&mut s, &mut next_id, "a", 1.0, 20);
        keep_backlogged(&mut s, &mut next_id, "b", 3.0, 20);
        step(&mut s);
        service.retire_done(&mut s);
    }
    // Service divided by the weight is what the counter evens out: in raw tokens, b gets
    // three times a's.
    let raw_a = service.of(&s, "a");
    let raw_b = service.of(&s, "b") * 3.0;
    let ratio = raw_b / raw_a;
    assert!((2.7..3.3).contains(&ratio), "b/a = {ratio}");
}

#[test]
fn fair_gives_a_tenant_returning_from_idleness_no_credit_for_it() {
    let mut s = with_policy(setup(32, 4, 64), SchedulingPolicy::Fair);
    let (mut service, mut next_id) = (Service::default(), 0);
    // a is served alone for a while; b's counter stays at 0 meanwhile.
    for _ in 0..300 {
        keep_backlogged(&mut s, &mut next_id, "a", 1.0, 20);
        step(&mut s);
        service.retire_done(&mut s);
    }
    let before = (service.of(&s, "a"), service.of(&s, "b"));
    assert!(before.0 > 1000.0 && before.1 == 0.0);
    // Now both are backlogged: without the lift b would be served alone until it caught
    // up with a's 1000+ tokens; with it they share from the start.
    for _ in 0..100 {
        keep_backlogged(&mut s, &mut next_id, "a", 1.0, 20);
        keep_backlogged(&mut s, &mut next_id, "b", 1.0, 20);
        step(&mut s);
        service.retire_done(&mut s);
    }
    let gained_a = service.of(&s, "a") - before.0;
    let gained_b = service.of(&s, "b");
    let share = gained_a / (gained_a + gained_b);
    assert!(
        (0.4..0.6).contains(&share),
        "a's share after b's return: {share}"
    );
    assert!(
        s.counters().counter("b") >= before.0 * 0.9,
        "b was lifted to a's counter"
    );
}

#[test]
fn fair_without_tenants_admits_in_arrival_order() {
    // Every request in the anonymous tenant: the same steps as fcfs.
    let lens = [8, 3, 12, 5, 9, 4];
    let mut fair = with_policy(setup(16, 3, 64), SchedulingPolicy::Fair);
    let mut fcfs = with_policy(setup(16, 3, 64), SchedulingPolicy::Fcfs);
    for (id, &len) in lens.iter().enumerate() {
        fair.add(tenant_seq(id as u64, len, 4, "", 1.0));
        fcfs.add(tenant_seq(id as u64, len, 4, "", 1.0));
    }
    let (mut a, mut b) = (Service::default(), Service::default());
    for _ in 0..20 {
        let (x, y) = (step(&mut fair), step(&mut fcfs));
        assert_eq!(x.step, y.step);
        a.retire_done(&mut fair);
        b.retire_done(&mut fcfs);
    }
}

#[test]
fn fair_preempts_from_the_tenant_with_the_largest_counter() {
    // 6 blocks of 4: a's 15-token prompt takes 4, b's 7-token one 2; a's second decode
    // needs a 5th block. fcfs preempts the latest arrival (b), fair the tenant served
    // most (a: 15 prompt tokens to b's 7).
    for (policy, victim) in [(SchedulingPolicy::Fcfs, 1), (SchedulingPolicy::Fair, 0)] {
        let mut s = with_policy(setup(64, 8, 6), policy);
        s.add(tenant_seq(0, 15, 8, "a", 1.0));
        s.add(tenant_seq(1, 7, 8, "b", 1.0));
        let preempted = (0..4)
            .map(|_| step(&mut s).preempted)
            .find(|p| !p.is_empty());
        assert_eq!(preempted, Some(vec![victim]), "{policy:?}");
    }
}

#[test]
fn fair_lets_a_starved_tenant_displace_the_most_served_one_when_the_batch_is_full() {
    let mut s = with_policy(setup(64, 4, 64), SchedulingPolicy::Fair);
    for id in 0..8 {
        s.add(tenant_seq(id, 8, 50, "a", 1.0));
    }
    for _ in 0..5 {
        step(&mut s);
    }
    assert_eq!(s.num_running(), 4);
    s.add(tenant_seq(100, 8, 4, "b", 1.0));
    let out = step(&mut s);
    // a's latest running request makes room; b joins in the same step.
    assert_eq!(out.preempted, vec![3]);
    assert!(out.step.unwrap().joined.iter().any(|j| j.id == 100));
    // a's preempted request does not displace b back: a holds more of the batch.
    let out = step(&mut s);
    assert!(out.preempted.is_empty());
}

/// Priority scheduling with a batch of one: a request of priority 5 waits behind a
/// stream of priority-0 requests (one waiting at any time) until aging lifts it, steps
/// 100 ms apart. Returns the time it waited.
fn low_priority_wait(policy: SchedulingPolicy) -> Option<Duration> {
    let mut s = with_policy(setup(64, 1, 64), policy);
    let start = Instant::now();
    let mut low = tenant_seq(0, 4, 2, "", 1.0);
    low.priority = 5;
    low.arrived = start;
    let mut high = tenant_seq(1, 4, 2, "", 1.0);
    high.arrived = start;
    s.add(high);
    s.add(low);
    let mut service = Service::default();
    let mut next_id = 2;
    for n in 1..200u32 {
        let now = start + Duration::from_millis(100) * n;
        if s.waiting().iter().all(|q| q.priority == 5) {
            let mut high = tenant_seq(next_id, 4, 2, "", 1.0);
            high.arrived = now;
            s.add(high);
            next_id += 1;
        }
        if step_at(&mut s, now).admitted.contains(&0) {
            return Some(now - start);
        }
        service.retire_done(&mut s);
    }
    None
}

#[test]
fn priority_aging_bounds_a_low_priority_requests_wait() {
    // 5 levels at one level a second: it ranks with fresh priority-0 requests after 5 s,
    // and goes once the one waiting then arrived after it had aged that far.
    let waited = low_priority_wait(SchedulingPolicy::Priority).expect("aging admits it");
    let aging = crate::scheduler::priority::AGING_INTERVAL * 5;
    assert!(waited >= aging - Duration::from_millis(500), "{waited:?}");
    assert!(waited <= aging + Duration::from_secs(1), "{waited:?}");
    // fcfs takes it in arrival order, right after the first priority-0 request.
    let waited = low_priority_wait(SchedulingPolicy::Fcfs).unwrap();
    assert!(waited <= Duration::from_millis(500), "{waited:?}");
}

#[test]
fn priority_preempts_the_worst_running_request_for_a_better_one_when_the_cache_is_full() {
    // 6 blocks of 4: three 8-token prompts take them all.
    let mut s = with_policy(setup(64, 8, 6), SchedulingPolicy::Priority);
    let now = Instant::now();
    for (id, priority) in [(0, 1), (1, 3), (2, 2)] {
        let mut q = tenant_seq(id, 7, 2, "", 1.0);
        q.priority = priority;
        q.arrived = now;
        s.add(q);
    }
    step_at(&mut s, now);
    assert_eq!(s.num_running(), 3);
    let mut urgent = tenant_seq(3, 7, 2, "", 1.0);
    urgent.priority = 0;
    urgent.arrived = now;
    s.add(urgent);
    let out = step_at(&mut s, now);
    assert_eq!(out.preempted, vec![1], "priority 3 is the worst");
    assert!(out.step.unwrap().joined.iter().any(|j| j.id == 3));
    // A request no better than every running one preempts nothing.
    let mut equal = tenant_seq(4, 7, 2, "", 1.0);
    equal.priority = 2;
    equal.arrived = now;
    s.add(equal);
    let out = step_at(&mut s, now);
    assert!(out.preempted.is_empty());
}
