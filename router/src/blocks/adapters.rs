//! LoRA adapters as a second kind of block owner (unified paging): a resident adapter
//! holds `num_blocks` blocks of the pool for its weights, taken like any block (free list
//! first, then eviction by last use). It is reference-counted by the running requests that
//! use it; at zero it goes on `adapter_lru` and stays resident until an allocation evicts
//! it (all its blocks at once) or the scheduler drops it. Every eviction is recorded in
//! `evicted`, whose names leave with the next step's `adapters_out`.

use super::{BlockId, BlockManager};

/// One adapter paged into the pool.
#[derive(Debug, Clone)]
pub(super) struct ResidentAdapter {
    pub(super) blocks: Vec<BlockId>,
    /// Running requests using it.
    pub(super) users: usize,
    /// Its `adapter_lru` key while no running request uses it.
    pub(super) lru_key: Option<u64>,
}

impl BlockManager {
    /// Pages adapter `name` in for a first user: takes `num_blocks` blocks (evicting by
    /// last use when needed) and returns them for the step's `adapters_in`. All or nothing:
    /// None when too few blocks are free or evictable (nothing changed).
    pub fn page_in(&mut self, name: &str, num_blocks: usize) -> Option<Vec<BlockId>> {
        assert!(
            !self.adapters.contains_key(name),
            "adapter {name} is already resident"
        );
        if num_blocks > self.num_free() {
            return None;
        }
        let blocks: Vec<BlockId> = (0..num_blocks)
            .map(|_| self.take().expect("checked above"))
            .collect();
        self.adapters.insert(
            name.to_string(),
            ResidentAdapter {
                blocks: blocks.clone(),
                users: 1,
                lru_key: None,
            },
        );
        Some(blocks)
    }

    /// One more running request uses resident adapter `name` (taken off the LRU list when
    /// it was idle). False when it is not resident.
    pub fn acquire_adapter(&mut self, name: &str) -> bool {
        let Some(a) = self.adapters.get_mut(name) else {
            return false;
        };
        if let Some(key) = a.lru_key.take() {
            self.adapter_lru.remove(&key);
            self.idle_adapter_blocks -= a.blocks.len();
        }
        a.users += 1;
        true
    }

    /// A running request stopped using adapter `name`; the last one puts it on the LRU
    /// list, stamped now. Returns how many requests still use it.
    pub fn release_adapter(&mut self, name: &str) -> usize {
        let a = self
            .adapters
            .get_mut(name)
            .unwrap_or_else(|| panic!("adapter {name} released but not resident"));
        assert!(a.users > 0, "adapter {name} released more than acquired");
        a.users -= 1;
        if a.users == 0 {
            self.clock += 1;
            a.lru_key = Some(self.clock);
            self.adapter_lru.insert(self.clock, name.to_string());
            self.idle_adapter_blocks += a.blocks.len();
        }
        a.users
    }

    /// Evicts adapter `name` now if it is resident and no running request uses it (an
    /// adapter being unloaded); true when it was.
    pub fn evict_adapter(&mut self, name: &str) -> bool {
        let Some(key) = self.adapters.get(name).and_then(|a| a.lru_key) else {
            return false;
        };
        self.adapter_lru.remove(&key);
        self.evict_idle(name);
        true
    }

    /// Frees an idle adapter's blocks (already off `adapter_lru`) and records its eviction.
    pub(super) fn evict_idle(&mut self, name: &str) {
        let a = self
            .adapters
            .remove(name)
            .expect("an idle adapter is resident");
        debug_assert_eq!(a.users, 0);
        self.idle_adapter_blocks -= a.blocks.len();
        self.free_adapter_blocks(&a.blocks);
        self.evicted.push(name.to_string());
    }

    fn free_adapter_blocks(&mut self, blocks: &[BlockId]) {
        for &b in blocks.iter().rev() {
            debug_assert_eq!(self.refcounts[b as usize], 1);
            self.refcounts[b as usize] = 0;
            self.used -= 1;
            self.free.push(b);
        }
    }

    /// The adapters evicted since the last call, oldest first.
    pub fn take_evicted(&mut self) -> Vec<String> {
        std::mem::take(&mut self.evicted)
    }

    /// Forgets every resident adapter without recording evictions (the shards' session
    /// ended, so they hold none). Call once no running request uses any.
    pub fn clear_adapters(&mut self) {
        let all: Vec<ResidentAdapter> = self.adapters.drain().map(|(_, a)| a).collect();
        for a in all {
            self.free_adapter_blocks(&a.blocks);
        }
        self.adapter_lru.clear();
        self.idle_adapter_blocks = 0;
        self.evicted.clear();
    }

    /// Running requests using adapter `name`; None when it is not resident.
    pub fn adapter_users(&self, name: &str) -> Option<usize> {
        self.adapters.get(name).map(|a| a.users)
    }

    /// The blocks adapter `name` holds (empty when it is not resident).
    pub fn adapter_blocks(&self, name: &str) -> &[BlockId] {
        self.adapters
            .get(name)
            .map(|a| a.blocks.as_slice())
            .unwrap_or(&[])
    }

    /// Resident adapters, with how many running requests use each.
    pub fn resident_adapters(&self) -> impl Iterator<Item = (&str, usize)> {
        self.adapters.iter().map(|(n, a)| (n.as_str(), a.users))
    }

    /// Resident adapters that running requests use (the batch's distinct adapters).
    pub fn active_adapters(&self) -> usize {
        self.adapters.values().filter(|a| a.users > 0).count()
    }

    /// Blocks held by resident adapters, idle or not.
    pub fn num_adapter_blocks(&self) -> usize {
        self.adapters.values().map(|a| a.blocks.len()).sum()
    }

    /// Blocks held by resident adapters that running requests use (the rest can be
    /// evicted when blocks are needed).
    pub fn num_adapter_blocks_in_use(&self) -> usize {
        self.adapters
            .values()
            .filter(|a| a.users > 0)
            .map(|a| a.blocks.len())
            .sum()
    }

    /// Adds one reference per adapter block to `refs` and checks the adapters' own
    /// bookkeeping: idle ones (and only they) are on the LRU list under their key, and
    /// `idle_adapter_blocks` counts their blocks.
    pub(super) fn check_adapters(&self, refs: &mut [u32]) -> Result<(), String> {
        let mut idle_blocks = 0;
        for (name, a) in &self.adapters {
            for &b in &a.blocks {
                *refs
                    .get_mut(b as usize)
                    .ok_or_else(|| format!("adapter {name} holds unknown block {b}"))? += 1;
            }
            match a.lru_key {
                Some(key) if a.users == 0 => {
                    if self.adapter_lru.get(&key).map(String::as_str) != Some(name) {
                        return Err(format!("idle adapter {name}: stale LRU key"));
                    }
                    idle_blocks += a.blocks.len();
                }
                None if a.users > 0 => {}
                _ => {
                    return Err(format!(
                        "adapter {name}: {} users, LRU key {:?}",
                        a.users, a.lru_key
                    ))
                }
            }
        }
        if self.adapter_lru.len() != self.adapters.values().filter(|a| a.users == 0).count() {
            return Err("the adapter LRU lists an adapter that is not idle".into());
        }
        if idle_blocks != self.idle_adapter_blocks {
            return Err(format!(
                "{} idle adapter blocks counted, {idle_blocks} held",
                self.idle_adapter_blocks
            ));
        }
        Ok(())
    }
}
