//! Which replica a new request goes to: the least loaded one, unless a replica already
//! holds the request's prompt prefix in its KV cache (it served a request with the same
//! first blocks) and is not much busier, since a prefix hit there skips that prefill.
//!
//! Load is the requests a replica holds (sent to it and not ended: counted at once, not
//! at the next step, so a burst spreads), then its KV use. Affinity is kept per prompt
//! block: the hash of the prompt's first k full blocks for every k, mapped to the replica
//! that last got a prompt starting with them; the deepest match wins. The map is bounded
//! (oldest entries forgotten first) and only a hint: a replica may have evicted the
//! blocks since, which costs a prefill, never a wrong answer.

use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Mutex;

/// A replica may hold this many more requests than the least loaded one and still get a
/// request whose prefix it caches.
pub const AFFINITY_SLACK: usize = 4;
/// Prompt blocks looked at for affinity (a longer shared prefix than this is rare, and
/// hashing it would cost for nothing).
const MAX_AFFINITY_BLOCKS: usize = 64;
/// Prefix hashes remembered; past this the older half is forgotten.
const MAX_ENTRIES: usize = 1 << 16;

/// A replica as the balancer sees it at one request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReplicaLoad {
    /// Requests sent to the replica and not ended yet.
    pub assigned: usize,
    /// Fraction of its KV blocks in use (0 to 1), as of its last step.
    pub kv_usage: f64,
    /// False once its readiness check failed: it gets requests only if none is ready.
    pub ready: bool,
}

/// Picks replicas and remembers which one got which prompt prefix.
#[derive(Debug)]
pub struct Balancer {
    block_size: usize,
    owners: Mutex<Owners>,
}

#[derive(Debug, Default)]
struct Owners {
    /// Prefix hash -> (replica, when it was last chosen for that prefix).
    by_prefix: HashMap<u64, (usize, u64)>,
    clock: u64,
}

impl Balancer {
    pub fn new(block_size: usize) -> Self {
        Self {
            block_size: block_size.max(1),
            owners: Mutex::new(Owners::default()),
        }
    }

    /// The replica for a prompt of `tokens`, given each replica's load (one entry per
    /// replica, at least one), and remembers the choice for the prompt's prefixes.
    pub fn pick(&self, tokens: &[u32], loads: &[ReplicaLoad]) -> usize {
        if loads.len() == 1 {
            return 0;
        }
        let any_ready = loads.iter().any(|l| l.ready);
        let eligible = |i: usize| loads[i].ready || !any_ready;
        let least = (0..loads.len())
            .filter(|&i| eligible(i))
            .min_by(|&a, &b| {
                let (la, lb) = (loads[a], loads[b]);
                la.assigned
                    .cmp(&lb.assigned)
                    .then(la.kv_usage.total_cmp(&lb.kv_usage))
            })
            .expect("at least one replica is eligible");
        let prefixes = self.prefix_hashes(tokens);
        let mut owners = self.owners.lock().expect("balancer lock");
        let affine = prefixes
            .iter()
            .rev()
            .find_map(|h| owners.by_prefix.get(h).map(|&(replica, _)| replica))
            .filter(|&r| r < loads.len() && eligible(r));
        let chosen = match affine {
            Some(r) if loads[r].assigned <= loads[least].assigned + AFFINITY_SLACK => r,
            _ => least,
        };
        owners.remember(&prefixes, chosen);
        chosen
    }

    /// The chained hashes of the prompt's full blocks, shortest prefix first.
    fn prefix_hashes(&self, tokens: &[u32]) -> Vec<u64> {
        let mut chain = 0u64;
        tokens
            .chunks_exact(self.block_size)
            .take(MAX_AFFINITY_BLOCKS)
            .map(|block| {
                let mut h = DefaultHasher::new();
                chain.hash(&mut h);
                block.hash(&mut h);
                chain = h.finish();
                chain
            })
            .collect()
    }
}

impl Owners {
    fn remember(&mut self, prefixes: &[u64], replica: usize) {
        self.clock += 1;
        for &h in prefixes {
            self.by_prefix.insert(h, (replica, self.clock));
        }
        if self.by_prefix.len() > MAX_ENTRIES {
            let mut ages: Vec<u64> = self.by_prefix.values().map(|&(_, t)| t).collect();
            let median = *ages.select_nth_unstable(MAX_ENTRIES / 2).1;
            self.by_prefix.retain(|_, &mut (_, t)| t > median);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn idle(n: usize) -> Vec<ReplicaLoad> {
        vec![
            ReplicaLoad {
                assigned: 0,
                kv_usage: 0.0,
                ready: true,
            };
            n
        ]
    }

    fn prompt(first: u32, len: usize) -> Vec<u32> {
        (first..first + len as u32).collect()
    }

    #[test]
    fn new_prompts_go_to_the_least_loaded_replica_then_the_emptier_cache() {
        let b = Balancer::new(4);
        let mut loads = idle(3);
        loads[0].assigned = 2;
        loads[1].assigned = 1;
        loads[2].assigned = 1;
        loads[1].kv_usage = 0.5;
        loads[2].kv_usage = 0.25;
        assert_eq!(b.pick(&prompt(0, 10), &loads), 2);
    }

    #[test]
    fn a_burst_spreads_evenly_when_each_choice_is_counted() {
        let b = Balancer::new(4);
        let mut loads = idle(4);
        for i in 0..32u32 {
            let r = b.pick(&prompt(1000 * i, 3), &loads); // shorter than a block: no affinity
            loads[r].assigned += 1;
        }
        assert!(loads.iter().all(|l| l.assigned == 8), "{loads:?}");
    }

    #[test]
    fn a_shared_prefix_returns_to_its_replica_until_it_is_too_busy() {
        let b = Balancer::new(4);
        let mut loads = idle(2);
        loads[0].assigned = 1; // the first request goes to replica 1
        let system = prompt(0, 8);
        let with_question = |q: u32| [system.clone(), prompt(100 * q, 5)].concat();
        assert_eq!(b.pick(&with_question(1), &loads), 1);
        loads[1].assigned += 1;
        // Same two first blocks: back to replica 1 while within the slack.
        for q in 2..=2 + AFFINITY_SLACK as u32 {
            assert_eq!(b.pick(&with_question(q), &loads), 1);
            loads[1].assigned += 1;
        }
        // Replica 1 is now more than AFFINITY_SLACK ahead of replica 0.
        assert!(loads[1].assigned > loads[0].assigned + AFFINITY_SLACK);
        assert_eq!(b.pick(&with_question(99), &loads), 0);
        // A different prompt goes by load alone.
        assert_eq!(b.pick(&prompt(5000, 12), &loads), 0);
    }

    #[test]
    fn the_deepest_shared_prefix_decides() {
        let b = Balancer::new(2);
        let loads = idle(2);
        let a = prompt(0, 8);
        assert_eq!(b.pick(&a, &loads), 0);
        // Shares only the first block with `a`, then goes to replica 1 by fiat: record it.
        let mut other = prompt(0, 2);
        other.extend(prompt(50, 6));
        b.owners
            .lock()
            .unwrap()
            .remember(&b.prefix_hashes(&other), 1);
        // A prompt sharing `a`'s first three blocks follows `a`, not `other`.
        let mut follows_a = prompt(0, 6);
        follows_a.extend(prompt(900, 2));
        assert_eq!(b.pick(&follows_a, &loads), 0);
        let mut follows_other = other.clone();
        follows_other.extend(prompt(700, 2));
        assert_eq!(b.pick(&follows_other, &loads), 1);
    }

    #[test]
    fn a_replica_that_is_not_ready_gets_nothing_while_another_is() {
        let b = Balancer::new(4);
        let mut loads = idle(2);
        let p = prompt(0, 8);
        assert_eq!(b.pick(&p, &loads), 0);
        loads[0].ready = false;
        loads[1].assigned = 50;
        assert_eq!(
            b.pick(&p, &loads),
            1,
            "affinity does not override readiness"
        );
        loads[1].ready = false;
        assert_eq!(b.pick(&p, &loads), 0, "none ready: the least loaded");
    }

    #[test]
    fn the_prefix_map_stays_bounded() {
        let b = Balancer::new(1);
        let loads = idle(2);
        for i in 0..(MAX_ENTRIES as u32 / 4 + 10) {
            b.pick(&prompt(i * 10, 5), &loads);
        }
        assert!(b.owners.lock().unwrap().by_prefix.len() <= MAX_ENTRIES);
    }
}
