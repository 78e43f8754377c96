//! KV-cache block accounting. The shards hold the physical blocks; the router decides
//! which block ids each request owns.
//!
//! The allocator owns every request's block table, so freeing a request is one call
//! (`free`) that cannot forget a block, and `check_invariants` can prove nothing leaked.
//! Blocks carry reference counts so that prefix caching and copy-on-write can share
//! them later; today every block has exactly one owner.

use std::collections::HashMap;

pub type BlockId = u32;
pub type RequestId = u64;

#[derive(Debug)]
pub struct BlockAllocator {
    block_size: usize,
    /// Owners of each block; 0 = free.
    refcounts: Vec<u32>,
    /// Free block ids; the next one handed out is at the end.
    free: Vec<BlockId>,
    /// Each request's block table, in token order.
    tables: HashMap<RequestId, Vec<BlockId>>,
}

impl BlockAllocator {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        assert!(block_size > 0, "block_size must be positive");
        Self {
            block_size,
            refcounts: vec![0; num_blocks],
            free: (0..num_blocks as BlockId).rev().collect(),
            tables: HashMap::new(),
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.refcounts.len()
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Blocks needed to hold `num_tokens` tokens of KV.
    pub fn blocks_for(&self, num_tokens: usize) -> usize {
        num_tokens.div_ceil(self.block_size)
    }

    /// The block table of a request (empty if it holds none).
    pub fn table(&self, id: RequestId) -> &[BlockId] {
        self.tables.get(&id).map(Vec::as_slice).unwrap_or(&[])
    }

    /// Extra blocks `id` needs so its table covers `num_tokens` tokens.
    pub fn missing_for(&self, id: RequestId, num_tokens: usize) -> usize {
        self.blocks_for(num_tokens)
            .saturating_sub(self.table(id).len())
    }

    /// Grows `id`'s table to cover `num_tokens` tokens. All or nothing: returns false and
    /// changes nothing when too few blocks are free.
    pub fn grow_to(&mut self, id: RequestId, num_tokens: usize) -> bool {
        let missing = self.missing_for(id, num_tokens);
        if missing > self.free.len() {
            return false;
        }
        if missing == 0 {
            return true;
        }
        let table = self.tables.entry(id).or_default();
        for _ in 0..missing {
            let block = self.free.pop().expect("checked above");
            debug_assert_eq!(self.refcounts[block as usize], 0);
            self.refcounts[block as usize] = 1;
            table.push(block);
        }
        true
    }

    /// Drops every block `id` owns; returns how many references were released.
    pub fn free(&mut self, id: RequestId) -> usize {
        let Some(table) = self.tables.remove(&id) else {
            return 0;
        };
        for &block in &table {
            let rc = &mut self.refcounts[block as usize];
            debug_assert!(*rc > 0, "block {block} freed twice");
            *rc -= 1;
            if *rc == 0 {
                self.free.push(block);
            }
        }
        table.len()
    }

    /// Whether `id` holds any block.
    pub fn holds(&self, id: RequestId) -> bool {
        self.tables.contains_key(&id)
    }

    /// Every block is either free (refcount 0, once in the free list) or referenced
    /// exactly `refcount` times by the tables.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut seen = vec![0u32; self.refcounts.len()];
        for (id, table) in &self.tables {
            if table.is_empty() {
                return Err(format!("request {id} has an empty table"));
            }
            for &block in table {
                let slot = seen
                    .get_mut(block as usize)
                    .ok_or_else(|| format!("request {id} holds unknown block {block}"))?;
                *slot += 1;
            }
        }
        let mut in_free = vec![false; self.refcounts.len()];
        for &block in &self.free {
            let slot = in_free
                .get_mut(block as usize)
                .ok_or_else(|| format!("unknown block {block} in the free list"))?;
            if *slot {
                return Err(format!("block {block} is twice in the free list"));
            }
            *slot = true;
        }
        for (block, (&rc, &refs)) in self.refcounts.iter().zip(&seen).enumerate() {
            if rc != refs {
                return Err(format!(
                    "block {block}: refcount {rc} but {refs} references"
                ));
            }
            if (rc == 0) != in_free[block] {
                return Err(format!(
                    "block {block}: refcount {rc}, in free list: {}",
                    in_free[block]
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    #[test]
    fn grow_is_all_or_nothing_and_free_returns_every_block() {
        let mut a = BlockAllocator::new(4, 16);
        assert!(a.grow_to(1, 33)); // 3 blocks
        assert_eq!(a.table(1).len(), 3);
        assert!(!a.grow_to(2, 17)); // needs 2, 1 free
        assert!(!a.holds(2));
        assert_eq!(a.num_free(), 1);
        assert!(a.grow_to(1, 48)); // still 3 blocks
        assert_eq!(a.table(1).len(), 3);
        assert_eq!(a.free(1), 3);
        assert_eq!(a.num_free(), 4);
        a.check_invariants().unwrap();
    }

    #[test]
    fn random_grow_and_free_sequences_keep_the_invariants() {
        let mut rng = StdRng::seed_from_u64(7);
        for _ in 0..20 {
            let num_blocks = rng.random_range(1..64);
            let mut a = BlockAllocator::new(num_blocks, rng.random_range(1..8));
            let mut tokens: HashMap<RequestId, usize> = HashMap::new();
            for _ in 0..500 {
                let id = rng.random_range(0..12u64);
                if rng.random_bool(0.25) {
                    let held = a.table(id).len();
                    assert_eq!(a.free(id), held);
                    tokens.remove(&id);
                } else {
                    let cur = tokens.get(&id).copied().unwrap_or(0);
                    let want = cur + rng.random_range(1..40);
                    let free_before = a.num_free();
                    let missing = a.missing_for(id, want);
                    if a.grow_to(id, want) {
                        tokens.insert(id, want);
                        assert_eq!(a.num_free(), free_before - missing);
                        assert!(a.table(id).len() * a.block_size() >= want);
                    } else {
                        assert!(missing > free_before);
                        assert_eq!(a.num_free(), free_before);
                    }
                }
                a.check_invariants().unwrap();
                let held: usize = tokens.keys().map(|&id| a.table(id).len()).sum();
                assert_eq!(held + a.num_free(), a.num_blocks());
            }
        }
    }
}
