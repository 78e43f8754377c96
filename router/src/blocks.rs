//! The KV block manager. The shards hold the physical blocks; the router decides which
//! block ids each request owns, which blocks several requests share, and which freed
//! blocks keep their content for later prefix hits.
//!
//! Every block is in exactly one of three states:
//! - **used**: referenced by `refcount > 0` block tables (shared when > 1), or holding the
//!   weights of a paged-in LoRA adapter (refcount 1, never in a table: `adapters`);
//! - **cached**: refcount 0 but holding the KV of a known full block, reusable by a prefix
//!   hit and evicted least-recently-used when a fresh block is needed;
//! - **free**: refcount 0, content meaningless.
//!
//! Unified paging (`adapters`): a resident adapter's blocks come from the same free list,
//! and an adapter no running request uses waits on an LRU list beside the cached prefix
//! blocks. Both lists are stamped by one clock, so eviction goes by last use across them:
//! when a fresh block is needed and none is free, the older of the oldest cached prefix
//! block and the least recently used idle adapter goes (an adapter with all its blocks
//! at once).
//!
//! Prefix caching: a full block is identified by a hash of its token ids chained with the
//! previous block's hash (so a block hash names the whole prefix up to it), seeded with
//! the adapter id. The cache index maps hash → block and keeps the block's tokens, so a
//! hash collision can never hand out the wrong KV. A block is registered when the step
//! that computes it is scheduled and becomes *ready* (hit-able) at the next schedule, once
//! that step has run.
//!
//! Copy-on-write: a shared block about to be written (a partial block after `fork`) is
//! first copied into a fresh block; `prepare_write` returns the copy for the Step.

mod adapters;

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};

use adapters::ResidentAdapter;

pub type BlockId = u32;
pub type RequestId = u64;

/// What the cache knows about a registered full block.
#[derive(Debug, Clone)]
struct CachedBlock {
    hash: u64,
    parent: u64,
    tokens: Box<[u32]>,
    /// False until the step computing it has run.
    ready: bool,
}

#[derive(Debug, Default, Clone)]
struct Table {
    blocks: Vec<BlockId>,
    /// Chained hashes of the leading full blocks hashed so far.
    hashes: Vec<u64>,
}

/// The result of looking a prompt up in the prefix cache.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PrefixMatch {
    /// Ready cached blocks covering the leading full blocks of the prompt.
    pub blocks: Vec<BlockId>,
    pub hashes: Vec<u64>,
    /// The next block is being computed by the running step: waiting one step would
    /// turn it into a hit.
    pub pending: bool,
}

#[derive(Debug)]
pub struct BlockManager {
    block_size: usize,
    caching: bool,
    refcounts: Vec<u32>,
    /// Free blocks (no content); the next one handed out is at the end.
    free: Vec<BlockId>,
    /// Cached blocks with refcount 0, by last use (oldest first).
    lru: BTreeMap<u64, BlockId>,
    /// The `lru` key of each block while it is there.
    lru_key: Vec<u64>,
    clock: u64,
    cached: Vec<Option<CachedBlock>>,
    index: HashMap<u64, BlockId>,
    /// Blocks registered since the last `mark_ready`.
    pending: Vec<BlockId>,
    tables: HashMap<RequestId, Table>,
    used: usize,
    /// LoRA adapters paged into the pool, by name.
    adapters: HashMap<String, ResidentAdapter>,
    /// Resident adapters no running request uses, by last use (stamped by `clock`, as
    /// `lru` is), oldest first.
    adapter_lru: BTreeMap<u64, String>,
    /// Blocks of the adapters in `adapter_lru` (evictable, so counted free).
    idle_adapter_blocks: usize,
    /// Adapters evicted since the last `take_evicted`: the shards must forget them.
    evicted: Vec<String>,
}

/// The chain's seed: blocks computed under different adapters never match.
pub fn chain_seed(adapter_id: &str) -> u64 {
    let mut h = DefaultHasher::new();
    "cadence-prefix".hash(&mut h);
    adapter_id.hash(&mut h);
    h.finish()
}

/// The hash of a full block given its parent's hash (or the chain seed).
pub fn block_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

impl BlockManager {
    pub fn new(num_blocks: usize, block_size: usize, caching: bool) -> Self {
        assert!(block_size > 0, "block_size must be positive");
        Self {
            block_size,
            caching,
            refcounts: vec![0; num_blocks],
            free: (0..num_blocks as BlockId).rev().collect(),
            lru: BTreeMap::new(),
            lru_key: vec![0; num_blocks],
            clock: 0,
            cached: vec![None; num_blocks],
            index: HashMap::new(),
            pending: Vec::new(),
            tables: HashMap::new(),
            used: 0,
            adapters: HashMap::new(),
            adapter_lru: BTreeMap::new(),
            idle_adapter_blocks: 0,
            evicted: Vec::new(),
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn caching(&self) -> bool {
        self.caching
    }

    pub fn num_blocks(&self) -> usize {
        self.refcounts.len()
    }

    /// Blocks a request can take: free plus evictable (cached-and-unused prefix blocks,
    /// and the blocks of resident adapters no running request uses).
    pub fn num_free(&self) -> usize {
        self.free.len() + self.lru.len() + self.idle_adapter_blocks
    }

    /// Blocks referenced by at least one table or holding a resident adapter.
    pub fn num_used(&self) -> usize {
        self.used
    }

    /// Unused blocks that keep reusable content.
    pub fn num_cached(&self) -> usize {
        self.lru.len()
    }

    pub fn refcount(&self, block: BlockId) -> u32 {
        self.refcounts[block as usize]
    }

    /// Blocks needed to hold `num_tokens` tokens of KV.
    pub fn blocks_for(&self, num_tokens: usize) -> usize {
        num_tokens.div_ceil(self.block_size)
    }

    /// The block table of a request (empty if it holds none).
    pub fn table(&self, id: RequestId) -> &[BlockId] {
        self.tables
            .get(&id)
            .map(|t| t.blocks.as_slice())
            .unwrap_or(&[])
    }

    /// Whether `id` holds any block.
    pub fn holds(&self, id: RequestId) -> bool {
        self.tables.contains_key(&id)
    }

    /// Extra blocks `id` needs so its table covers `num_tokens` tokens.
    pub fn missing_for(&self, id: RequestId, num_tokens: usize) -> usize {
        self.blocks_for(num_tokens)
            .saturating_sub(self.table(id).len())
    }

    /// Takes one block: a free one, else what eviction frees (`evict_oldest`).
    fn take(&mut self) -> Option<BlockId> {
        while self.free.is_empty() {
            self.evict_oldest()?;
        }
        let block = self.free.pop()?;
        debug_assert_eq!(self.refcounts[block as usize], 0);
        self.refcounts[block as usize] = 1;
        self.used += 1;
        Some(block)
    }

    /// Frees the least recently used evictable thing: the oldest cached prefix block or the
    /// least recently used idle adapter, whichever was stamped first. None when nothing is
    /// evictable.
    fn evict_oldest(&mut self) -> Option<()> {
        let prefix = self.lru.first_key_value().map(|(&k, _)| k);
        let adapter = self.adapter_lru.first_key_value().map(|(&k, _)| k);
        let prefix_first = match (prefix, adapter) {
            (None, None) => return None,
            (Some(p), Some(a)) => p < a,
            (p, _) => p.is_some(),
        };
        if prefix_first {
            let (_, b) = self.lru.pop_first().expect("it has a first entry");
            self.uncache(b);
            self.free.push(b);
        } else {
            let (_, name) = self.adapter_lru.pop_first().expect("it has a first entry");
            self.evict_idle(&name);
        }
        Some(())
    }

    /// Forgets a block's cached content (it is about to be overwritten).
    fn uncache(&mut self, block: BlockId) {
        if let Some(c) = self.cached[block as usize].take() {
            if self.index.get(&c.hash) == Some(&block) {
                self.index.remove(&c.hash);
            }
        }
    }

    fn acquire(&mut self, block: BlockId) {
        let rc = &mut self.refcounts[block as usize];
        if *rc == 0 {
            let key = self.lru_key[block as usize];
            let removed = self.lru.remove(&key);
            debug_assert_eq!(
                removed,
                Some(block),
                "an unused matched block is in the LRU"
            );
            self.used += 1;
        }
        *rc += 1;
    }

    fn release(&mut self, block: BlockId) {
        let rc = &mut self.refcounts[block as usize];
        debug_assert!(*rc > 0, "block {block} released twice");
        *rc -= 1;
        if *rc > 0 {
            return;
        }
        self.used -= 1;
        match &self.cached[block as usize] {
            Some(c) if c.ready => {
                self.clock += 1;
                self.lru.insert(self.clock, block);
                self.lru_key[block as usize] = self.clock;
            }
            _ => {
                self.uncache(block);
                self.free.push(block);
            }
        }
    }

    /// Grows `id`'s table to cover `num_tokens` tokens. All or nothing: returns false and
    /// changes nothing when too few blocks are free.
    pub fn grow_to(&mut self, id: RequestId, num_tokens: usize) -> bool {
        let missing = self.missing_for(id, num_tokens);
        if missing > self.num_free() {
            return false;
        }
        if missing == 0 {
            return true;
        }
        let mut new = Vec::with_capacity(missing);
        for _ in 0..missing {
            new.push(self.take().expect("checked above"));
        }
        self.tables.entry(id).or_default().blocks.extend(new);
        true
    }

    /// Drops every block `id` holds, last block first so that a prompt's tail is evicted
    /// before its head; returns how many references were released.
    pub fn free(&mut self, id: RequestId) -> usize {
        let Some(table) = self.tables.remove(&id) else {
            return 0;
        };
        for &block in table.blocks.iter().rev() {
            self.release(block);
        }
        table.blocks.len()
    }

    /// Cuts `id`'s table to its first `keep` blocks and releases the rest, last first:
    /// the blocks that held only rejected speculative tokens (never hashed, so they go
    /// back to the free list). Returns how many were released.
    pub fn truncate(&mut self, id: RequestId, keep: usize) -> usize {
        let Some(table) = self.tables.get_mut(&id) else {
            return 0;
        };
        if table.blocks.len() <= keep {
            return 0;
        }
        let dropped = table.blocks.split_off(keep);
        table.hashes.truncate(keep);
        for &block in dropped.iter().rev() {
            self.release(block);
        }
        dropped.len()
    }

    /// A child sharing every block of `parent` (parallel samples of one prompt).
    pub fn fork(&mut self, parent: RequestId, child: RequestId) {
        assert!(!self.holds(child), "fork into a request that holds blocks");
        let Some(table) = self.tables.get(&parent).cloned() else {
            return;
        };
        for &b in &table.blocks {
            self.acquire(b);
        }
        self.tables.insert(child, table);
    }

    /// Before `id` writes token positions `from..to`: every shared block among them is
    /// replaced by a private copy; returns the `(src, dst)` copies the shards must make
    /// first. All or nothing: `None` when too few blocks are free (nothing changed).
    pub fn prepare_write(
        &mut self,
        id: RequestId,
        from: usize,
        to: usize,
    ) -> Option<Vec<(BlockId, BlockId)>> {
        let shared = self.shared_in(id, from, to);
        if shared.is_empty() {
            return Some(Vec::new());
        }
        if shared.len() > self.num_free() {
            return None;
        }
        let mut copies = Vec::with_capacity(shared.len());
        for j in shared {
            let src = self.table(id)[j];
            let dst = self.take().expect("checked above");
            self.release(src);
            let table = self.tables.get_mut(&id).expect("it holds src");
            table.blocks[j] = dst;
            // The copy is private; hashes from it on no longer describe this table.
            table.hashes.truncate(j);
            copies.push((src, dst));
        }
        Some(copies)
    }

    /// Indexes in `id`'s table of the shared blocks covering positions `from..to`.
    fn shared_in(&self, id: RequestId, from: usize, to: usize) -> Vec<usize> {
        if from >= to {
            return Vec::new();
        }
        let table = self.table(id);
        let last = ((to - 1) / self.block_size).min(table.len().saturating_sub(1));
        (from / self.block_size..=last)
            .filter(|&j| j < table.len() && self.refcounts[table[j] as usize] > 1)
            .collect()
    }

    /// How many copies writing positions `from..to` of `id` would need.
    pub fn copies_needed(&self, id: RequestId, from: usize, to: usize) -> usize {
        self.shared_in(id, from, to).len()
    }

    /// The longest run of ready cached blocks that starts `tokens`, leaving at least one
    /// token to compute (the last prompt token must run to produce logits).
    pub fn match_prefix(&self, tokens: &[u32], seed: u64) -> PrefixMatch {
        let mut m = PrefixMatch::default();
        if !self.caching || tokens.is_empty() {
            return m;
        }
        let max_blocks = (tokens.len() - 1) / self.block_size;
        let mut parent = seed;
        for chunk in tokens.chunks_exact(self.block_size).take(max_blocks) {
            let hash = block_hash(parent, chunk);
            let Some(&block) = self.index.get(&hash) else {
                break;
            };
            let c = self.cached[block as usize]
                .as_ref()
                .expect("indexed blocks are cached");
            if c.parent != parent || *c.tokens != *chunk {
                break; // a hash collision: not this prefix
            }
            if !c.ready {
                m.pending = true;
                break;
            }
            m.blocks.push(block);
            m.hashes.push(hash);
            parent = hash;
        }
        m
    }

    /// How many blocks of a match are cached-and-unused (taking them shrinks `num_free`).
    pub fn unused_in(&self, m: &PrefixMatch) -> usize {
        m.blocks
            .iter()
            .filter(|&&b| self.refcounts[b as usize] == 0)
            .count()
    }

    /// Starts `id`'s table with the matched blocks (shared with their other holders).
    pub fn adopt_prefix(&mut self, id: RequestId, m: &PrefixMatch) {
        assert!(
            !self.holds(id),
            "adopt_prefix into a request that holds blocks"
        );
        if m.blocks.is_empty() {
            return;
        }
        for &b in &m.blocks {
            self.acquire(b);
        }
        self.tables.insert(
            id,
            Table {
                blocks: m.blocks.clone(),
                hashes: m.hashes.clone(),
            },
        );
    }

    /// Registers the full blocks of `id` among its first `num_tokens` tokens (whose KV the
    /// step being scheduled computes) in the prefix cache. A block whose prefix is already
    /// cached elsewhere stays private.
    pub fn register_full(&mut self, id: RequestId, tokens: &[u32], num_tokens: usize, seed: u64) {
        if !self.caching {
            return;
        }
        let bs = self.block_size;
        let Some(table) = self.tables.get_mut(&id) else {
            return;
        };
        let full = (num_tokens.min(tokens.len()) / bs).min(table.blocks.len());
        while table.hashes.len() < full {
            let j = table.hashes.len();
            let parent = table.hashes.last().copied().unwrap_or(seed);
            let chunk = &tokens[j * bs..(j + 1) * bs];
            let hash = block_hash(parent, chunk);
            table.hashes.push(hash);
            let block = table.blocks[j];
            if self.index.contains_key(&hash) || self.cached[block as usize].is_some() {
                continue;
            }
            self.cached[block as usize] = Some(CachedBlock {
                hash,
                parent,
                tokens: chunk.into(),
                ready: false,
            });
            self.index.insert(hash, block);
            self.pending.push(block);
        }
    }

    /// The step that computed the blocks registered so far has run: they can be hit.
    pub fn mark_ready(&mut self) {
        for b in std::mem::take(&mut self.pending) {
            if let Some(c) = self.cached[b as usize].as_mut() {
                c.ready = true;
            }
        }
    }

    /// Forgets every cached content (after a failed step the KV is unknown).
    pub fn clear_cache(&mut self) {
        while let Some((_, b)) = self.lru.pop_first() {
            self.uncache(b);
            self.free.push(b);
        }
        for c in &mut self.cached {
            *c = None;
        }
        self.index.clear();
        self.pending.clear();
        for t in self.tables.values_mut() {
            t.hashes.clear();
        }
    }

    /// Every block is exactly one of used (refcount = number of tables holding it, or 1 for
    /// an adapter's block), cached
    /// (refcount 0, in the LRU, indexed under its hash) or free (refcount 0, in the free
    /// list, no content); the index and the blocks' hashes agree.
    pub fn check_invariants(&self) -> Result<(), String> {
        let n = self.refcounts.len();
        let mut refs = vec![0u32; n];
        for (id, table) in &self.tables {
            if table.blocks.is_empty() {
                return Err(format!("request {id} has an empty table"));
            }
            if table.hashes.len() > table.blocks.len() {
                return Err(format!("request {id} has more hashes than blocks"));
            }
            for &block in &table.blocks {
                *refs
                    .get_mut(block as usize)
                    .ok_or_else(|| format!("request {id} holds unknown block {block}"))? += 1;
            }
        }
        // Adapter blocks: one reference each (the adapter's), never in a table.
        let table_refs = refs.clone();
        self.check_adapters(&mut refs)?;
        for (block, (&all, &tables)) in refs.iter().zip(&table_refs).enumerate() {
            if all != tables && tables > 0 {
                return Err(format!(
                    "block {block} holds an adapter and is in a request's table"
                ));
            }
        }
        let mut place = vec![""; n];
        for &block in &self.free {
            let slot = place
                .get_mut(block as usize)
                .ok_or_else(|| format!("unknown block {block} in the free list"))?;
            if !slot.is_empty() {
                return Err(format!("block {block} is twice in the free list"));
            }
            *slot = "free";
        }
        for (&key, &block) in &self.lru {
            let slot = place
                .get_mut(block as usize)
                .ok_or_else(|| format!("unknown block {block} in the LRU"))?;
            if !slot.is_empty() {
                return Err(format!("block {block} is both {slot} and cached"));
            }
            *slot = "cached";
            if self.lru_key[block as usize] != key {
                return Err(format!("block {block}: stale LRU key"));
            }
            match &self.cached[block as usize] {
                Some(c) if c.ready => {}
                _ => return Err(format!("block {block} is in the LRU without ready content")),
            }
        }
        let mut used = 0;
        for block in 0..n {
            let rc = self.refcounts[block];
            if rc != refs[block] {
                return Err(format!(
                    "block {block}: refcount {rc} but {} references",
                    refs[block]
                ));
            }
            if rc > 0 {
                used += 1;
                if !place[block].is_empty() {
                    return Err(format!("block {block} is used and {}", place[block]));
                }
            } else if place[block].is_empty() {
                return Err(format!(
                    "block {block} is lost (unused, not free, not cached)"
                ));
            }
            if place[block] == "free" && self.cached[block].is_some() {
                return Err(format!("free block {block} keeps cached content"));
            }
            if let Some(c) = &self.cached[block] {
                if self.index.get(&c.hash) != Some(&(block as BlockId)) {
                    return Err(format!("cached block {block} is not indexed"));
                }
                if block_hash(c.parent, &c.tokens) != c.hash {
                    return Err(format!("cached block {block}: hash does not match content"));
                }
            }
        }
        if used != self.used {
            return Err(format!("used count {} but {used} blocks used", self.used));
        }
        for (&hash, &block) in &self.index {
            match self.cached.get(block as usize) {
                Some(Some(c)) if c.hash == hash => {}
                _ => return Err(format!("index entry {hash:x} -> {block} is stale")),
            }
        }
        if !self.caching && (!self.index.is_empty() || !self.lru.is_empty()) {
            return Err("prefix caching is off but blocks are cached".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    const SEED: u64 = 1;

    #[test]
    fn grow_is_all_or_nothing_and_free_returns_every_block() {
        let mut a = BlockManager::new(4, 16, false);
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
    fn full_blocks_are_shared_by_a_later_prompt_and_evicted_lru() {
        let mut a = BlockManager::new(6, 2, true);
        let prompt = [1, 2, 3, 4, 5];
        assert!(a.grow_to(1, 5));
        a.register_full(1, &prompt, 5, SEED);
        // Not ready until the step that computes them has run.
        let m = a.match_prefix(&prompt, SEED);
        assert!(m.pending && m.blocks.is_empty());
        a.mark_ready();
        let m = a.match_prefix(&[1, 2, 3, 4, 9, 9], SEED);
        assert_eq!(m.blocks, a.table(1)[..2].to_vec());
        // Another seed (adapter) never matches.
        assert!(a.match_prefix(&prompt, SEED + 1).blocks.is_empty());
        // A prompt equal to the cached one still computes its last token.
        assert_eq!(a.match_prefix(&[1, 2, 3, 4], SEED).blocks.len(), 1);
        a.adopt_prefix(2, &m);
        assert_eq!(a.refcount(m.blocks[0]), 2);
        a.check_invariants().unwrap();
        a.free(1);
        a.free(2);
        assert_eq!((a.num_used(), a.num_cached(), a.num_free()), (0, 2, 6));
        a.check_invariants().unwrap();
        // Four fresh blocks come from the free list; the fifth evicts the cached tail
        // block (freed first) and keeps the head.
        assert!(a.grow_to(3, 10));
        assert_eq!(a.num_cached(), 1);
        assert_eq!(a.match_prefix(&prompt, SEED).blocks.len(), 1);
        a.check_invariants().unwrap();
    }

    #[test]
    fn writing_a_shared_partial_block_copies_it_first() {
        let mut a = BlockManager::new(4, 4, true);
        assert!(a.grow_to(1, 6)); // blocks [b0 full, b1 half]
        a.fork(1, 2);
        let shared = a.table(1)[1];
        assert_eq!(a.refcount(shared), 2);
        assert_eq!(a.copies_needed(2, 6, 7), 1);
        let copies = a.prepare_write(2, 6, 7).unwrap();
        let (src, dst) = copies[0];
        assert_eq!(src, shared);
        assert_eq!(a.table(2)[1], dst);
        assert_eq!(a.refcount(shared), 1);
        // The other holder now owns it alone and writes in place.
        assert_eq!(a.prepare_write(1, 6, 7), Some(vec![]));
        a.check_invariants().unwrap();
        a.fork(1, 3);
        a.fork(1, 4);
        assert_eq!(a.num_free(), 1);
        assert_eq!(a.prepare_write(3, 7, 8).unwrap().len(), 1);
        assert_eq!(a.prepare_write(4, 7, 8), None);
        a.check_invariants().unwrap();
    }

    #[test]
    fn adapters_take_pool_blocks_all_or_nothing_and_idle_ones_are_evicted_by_last_use() {
        let mut a = BlockManager::new(10, 2, true);
        assert!(a.grow_to(1, 6)); // 3 blocks
        assert_eq!(a.page_in("big", 8), None, "7 free: nothing taken");
        assert_eq!(a.num_free(), 7);
        let pages = a.page_in("x", 4).unwrap();
        assert!(pages.iter().all(|b| !a.table(1).contains(b)));
        assert_eq!((a.num_used(), a.num_free()), (7, 3));
        a.check_invariants().unwrap();
        // Idle: still resident, but its blocks count free.
        assert_eq!(a.release_adapter("x"), 0);
        assert_eq!(
            (a.num_used(), a.num_free(), a.num_adapter_blocks()),
            (7, 7, 4)
        );
        a.check_invariants().unwrap();
        // A request's prefix released after it: the adapter is older, so it goes first.
        a.register_full(1, &[1, 2, 3, 4, 5, 6], 6, SEED);
        a.mark_ready();
        a.free(1);
        assert_eq!(a.num_cached(), 3);
        assert!(a.grow_to(2, 2 * 4)); // 3 free + 1 by eviction
        assert_eq!(a.take_evicted(), ["x"]);
        assert_eq!((a.num_cached(), a.num_adapter_blocks()), (3, 0));
        a.check_invariants().unwrap();
        // Taken back by a user before eviction: off the LRU, never evicted.
        let _ = a.page_in("y", 2).unwrap();
        assert_eq!(a.release_adapter("y"), 0);
        assert!(a.acquire_adapter("y"));
        assert!(!a.evict_adapter("y"), "in use");
        assert!(a.grow_to(3, 2 * 3)); // evicts cached prefix blocks, never "y"
        assert!(a.take_evicted().is_empty());
        assert_eq!(a.adapter_users("y"), Some(1));
        a.check_invariants().unwrap();
    }

    /// The property test: thousands of random operations, the invariant check after each,
    /// and a model of what each request's blocks hold (a matched prefix must hold exactly
    /// the prompt's tokens).
    #[test]
    fn random_allocate_append_fork_free_evict_preempt_keep_the_invariants() {
        let mut rng = StdRng::seed_from_u64(7);
        let mut ops = 0;
        for round in 0..60 {
            let caching = round % 4 != 0;
            let bs = rng.random_range(1..5);
            let num_blocks = rng.random_range(2..40);
            let mut a = BlockManager::new(num_blocks, bs, caching);
            // Each live request: its tokens and how many have KV.
            let mut live: HashMap<RequestId, (Vec<u32>, usize)> = HashMap::new();
            // What each block holds, as the shards would: token per slot.
            let mut content: Vec<Vec<Option<u32>>> = vec![vec![None; bs]; num_blocks];
            let mut next_id = 0;
            for _ in 0..400 {
                ops += 1;
                match rng.random_range(0..10) {
                    // allocate: a new request, prefix hit first.
                    0..=2 => {
                        let id = next_id;
                        next_id += 1;
                        let len = rng.random_range(1..4 * bs + 3);
                        let tokens: Vec<u32> = (0..len).map(|_| rng.random_range(0..2)).collect();
                        let m = a.match_prefix(&tokens, SEED);
                        for (j, &b) in m.blocks.iter().enumerate() {
                            let want: Vec<Option<u32>> = tokens[j * bs..(j + 1) * bs]
                                .iter()
                                .map(|&t| Some(t))
                                .collect();
                            assert_eq!(content[b as usize], want, "a hit must hold the prompt");
                        }
                        let cached = m.blocks.len() * bs;
                        let need = a.blocks_for(len) - m.blocks.len();
                        if need <= a.num_free() - a.unused_in(&m) {
                            a.adopt_prefix(id, &m);
                            assert!(a.grow_to(id, len));
                            live.insert(id, (tokens, cached));
                        }
                    }
                    // append: compute the missing tokens (copy-on-write first), register,
                    // then one more generated token.
                    3..=5 => {
                        let Some(&id) = live.keys().nth(rng.random_range(0..live.len().max(1)))
                        else {
                            continue;
                        };
                        let (tokens, computed) = live.get_mut(&id).unwrap();
                        if a.grow_to(id, tokens.len()) {
                            let Some(copies) = a.prepare_write(id, *computed, tokens.len()) else {
                                continue;
                            };
                            for (src, dst) in copies {
                                content[dst as usize] = content[src as usize].clone();
                            }
                            for p in *computed..tokens.len() {
                                let b = a.table(id)[p / bs];
                                assert!(a.refcount(b) == 1, "write into a shared block");
                                content[b as usize][p % bs] = Some(tokens[p]);
                            }
                            *computed = tokens.len();
                            a.register_full(id, tokens, *computed, SEED);
                            tokens.push(rng.random_range(0..2));
                        }
                    }
                    // fork: a parallel sample sharing every block.
                    6 => {
                        if let Some(&id) = live.keys().next() {
                            let child = next_id;
                            next_id += 1;
                            a.fork(id, child);
                            let state = live[&id].clone();
                            live.insert(child, state);
                        }
                    }
                    // free (finish) or preempt (free, as recomputation does).
                    7 | 8 => {
                        if let Some(&id) = live.keys().next() {
                            let held = a.table(id).len();
                            assert_eq!(a.free(id), held);
                            live.remove(&id);
                        }
                    }
                    // evict: take every free block, forcing LRU eviction, then give back.
                    _ => {
                        let n = a.num_free();
                        let id = u64::MAX;
                        assert!(a.grow_to(id, n * bs));
                        assert_eq!(a.num_cached(), 0);
                        for &b in a.table(id) {
                            content[b as usize] = vec![None; bs];
                        }
                        a.free(id);
                    }
                }
                a.mark_ready();
                a.check_invariants().unwrap();
                assert_eq!(
                    a.num_used() + a.num_free(),
                    a.num_blocks(),
                    "every block is used, cached or free"
                );
            }
            for id in live.keys().copied().collect::<Vec<_>>() {
                a.free(id);
            }
            a.check_invariants().unwrap();
            assert_eq!(a.num_used(), 0);
        }
        assert!(ops >= 20_000);
    }
}
