//! The scheduler's bookkeeping invariants, checked by the tests after every step (and by
//! debug builds).

use std::collections::HashMap;

use super::{Preemption, Scheduler};

impl Scheduler {
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
        self.check_host_pool()
    }

    /// Every running request's adapter is resident, each resident adapter counts exactly
    /// the running requests that use it, and the batch holds at most
    /// `max_adapters_per_batch` of them.
    fn check_adapters(&self) -> Result<(), String> {
        let mut users: HashMap<&str, usize> = HashMap::new();
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

    /// Waiting requests hold no device state, their computed tokens are exactly those
    /// swapped out, and every host block is either unused or held by one of them.
    fn check_host_pool(&self) -> Result<(), String> {
        let mut host: Vec<u32> = self.host.unused().copied().collect();
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
