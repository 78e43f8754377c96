//! The scheduling policy (`--scheduling-policy`): which waiting request joins next, which
//! running request is preempted when blocks run out, and whether a waiting request may
//! displace a running one.
//!
//! - `fcfs`: arrival order (preempted requests first); the latest arrival is preempted.
//! - `fair`: the Virtual Token Counter (`vtc`): the backlogged tenant with the smallest
//!   counter goes first (its requests in arrival order); the victim is the latest
//!   arrival of the running tenant with the largest counter. When the first in line does
//!   not fit (batch or blocks full), a running tenant above it, holding more running
//!   requests than the waiting tenant, gives up its latest arrival: every backlogged
//!   tenant gets a place within a step instead of waiting for another tenant's requests
//!   to finish.
//! - `priority`: the smallest effective priority (`priority`, aged) goes first, ties in
//!   arrival order; the victim is the worst effective priority, latest arrival. When the
//!   first in line does not fit, a running request of strictly worse effective priority
//!   is preempted for it.
//!
//! Requests without a tenant share one anonymous tenant, so `fair` without API keys
//! orders as `fcfs` does.

use std::collections::HashMap;
use std::time::Instant;

use crate::blocks::RequestId;

use super::priority;
use super::sequence::Sequence;
use super::step::{chunk_len, StepPlan};
use super::vtc::VirtualCounters;
use super::{Batching, Scheduler};

/// `--scheduling-policy`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum SchedulingPolicy {
    #[default]
    Fcfs,
    Fair,
    Priority,
}

impl SchedulingPolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            SchedulingPolicy::Fcfs => "fcfs",
            SchedulingPolicy::Fair => "fair",
            SchedulingPolicy::Priority => "priority",
        }
    }
}

/// A request's rank under the policy: the smaller goes first, the larger is preempted
/// first. The id (arrival order) breaks ties.
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd)]
struct Rank(f64, RequestId);

impl Scheduler {
    /// The tenants' virtual counters (`fair`).
    pub fn counters(&self) -> &VirtualCounters {
        &self.counters
    }

    fn rank(&self, seq: &Sequence, now: Instant) -> Rank {
        let key = match self.config.policy {
            SchedulingPolicy::Fcfs => 0.0,
            SchedulingPolicy::Fair => self.counters.counter(&seq.tenant),
            SchedulingPolicy::Priority => priority::effective(seq.priority, seq.arrived, now),
        };
        Rank(key, seq.id)
    }

    /// Lifts the tenants that just became backlogged (`fair`); once per step.
    pub(super) fn observe_backlog(&mut self) {
        if self.config.policy == SchedulingPolicy::Fair {
            self.counters
                .observe_backlog(self.waiting.iter().map(|s| &s.tenant));
        }
    }

    /// Adds a step's work to `seq`'s tenant's counter (`fair`): the prompt tokens it
    /// computes for the first time (cached and recomputed ones are free) and the tokens
    /// it samples.
    pub(super) fn charge(&mut self, i: usize, computed: usize, sampled: usize) {
        if self.config.policy != SchedulingPolicy::Fair {
            return;
        }
        let seq = &mut self.running[i];
        let end = (seq.num_computed + computed).min(seq.prompt_len);
        let prompt = end.saturating_sub(seq.charged_prompt.max(seq.num_computed));
        seq.charged_prompt = seq.charged_prompt.max(end);
        self.counters
            .charge(&seq.tenant, seq.weight, prompt, sampled);
    }

    /// The waiting request to consider next (its index in the queue), passing over
    /// `passed`: under `fcfs` the first in line, else the smallest rank.
    pub(super) fn next_waiting(&self, passed: &[RequestId], now: Instant) -> Option<usize> {
        let mut candidates = self
            .waiting
            .iter()
            .enumerate()
            .filter(|(_, s)| !passed.contains(&s.id));
        if self.config.policy == SchedulingPolicy::Fcfs {
            return candidates.next().map(|(i, _)| i);
        }
        // Rank, then (`fair`: between tenants whose counters tie, as a lifted newcomer's
        // does, the one with fewer running requests) place in line: a tenant's requests in
        // queue order (preempted first).
        let fair = self.config.policy == SchedulingPolicy::Fair;
        let running = if fair {
            self.running_per_tenant()
        } else {
            HashMap::new()
        };
        let running_of = |s: &Sequence| running.get(&*s.tenant).copied().unwrap_or(0);
        candidates
            .map(|(i, s)| (self.rank(s, now).0, running_of(s), i))
            .min_by(|a, b| a.partial_cmp(b).expect("ranks are finite"))
            .map(|(_, _, i)| i)
    }

    /// The running request to preempt among those `eligible` (by index): the largest
    /// rank (`fcfs`: the latest arrival).
    pub(super) fn victim(&self, now: Instant, eligible: impl Fn(usize) -> bool) -> Option<usize> {
        (0..self.running.len())
            .filter(|&v| eligible(v))
            .map(|v| (self.rank(&self.running[v], now), v))
            .max_by(|a, b| a.0.partial_cmp(&b.0).expect("ranks are finite"))
            .map(|(_, v)| v)
    }

    /// Whether running request `a` ranks after running request `b` (is preempted first).
    pub(super) fn ranks_after(&self, a: usize, b: usize, now: Instant) -> bool {
        self.rank(&self.running[a], now) > self.rank(&self.running[b], now)
    }

    /// Preempts running requests, before anything is planned, for the first waiting
    /// request in line when it does not fit and the policy lets it displace them (see the
    /// module documentation). Continuous batching only.
    pub(super) fn displace(&mut self, now: Instant, plan: &mut StepPlan) {
        while let Some(v) = self.displacement(now) {
            let victim = self.running.remove(v);
            self.preempt(victim, plan);
        }
    }

    /// Whether the next schedule would displace a running request (`schedule_ahead`
    /// leaves that to it).
    pub(super) fn displacement_due(&self, now: Instant) -> bool {
        self.displacement(now).is_some()
    }

    /// The running request the first waiting one in line displaces, if any.
    fn displacement(&self, now: Instant) -> Option<usize> {
        if self.config.policy == SchedulingPolicy::Fcfs
            || self.config.batching != Batching::Continuous
        {
            return None;
        }
        let passed: Vec<RequestId> = self
            .waiting
            .iter()
            .filter(|s| s.awaits_adapter())
            .map(|s| s.id)
            .collect();
        let first = self.waiting.get(self.next_waiting(&passed, now)?)?;
        if self.fits_now(first) {
            return None;
        }
        match self.config.policy {
            SchedulingPolicy::Fair => {
                let running = self.running_per_tenant();
                let running_of = |t: &str| running.get(t).copied().unwrap_or(0);
                let mine = running_of(&first.tenant);
                let counter = self.counters.counter(&first.tenant);
                self.victim(now, |v| {
                    let tenant = &self.running[v].tenant;
                    *tenant != first.tenant
                        && self.counters.counter(tenant) >= counter
                        && running_of(tenant) > mine
                })
            }
            SchedulingPolicy::Priority => {
                let v = self.victim(now, |_| true)?;
                let worse = self.rank(&self.running[v], now).0 > self.rank(first, now).0;
                worse.then_some(v)
            }
            SchedulingPolicy::Fcfs => None,
        }
    }

    /// Each tenant's running requests.
    fn running_per_tenant(&self) -> HashMap<&str, usize> {
        let mut counts = HashMap::new();
        for seq in &self.running {
            *counts.entry(&*seq.tenant).or_insert(0) += 1;
        }
        counts
    }

    /// Whether `seq` could join now with its first chunk: a place in the batch and the
    /// blocks (counted without its cached prefix, so a displacement may free a little
    /// more than needed, never less).
    fn fits_now(&self, seq: &Sequence) -> bool {
        if self.running.len() >= self.config.max_batch_size {
            return false;
        }
        let n = chunk_len(
            seq.remaining().max(1),
            self.config.max_batch_tokens,
            self.config.max_prefill_chunk,
        );
        let need = self.blocks.blocks_for(seq.num_computed + n) + seq.adapter_blocks.unwrap_or(0);
        need <= self.blocks.num_free()
    }
}
