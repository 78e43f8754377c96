//! Prompt-lookup proposals: the tokens that followed the latest earlier occurrence of
//! the sequence's last n tokens, longest n first. Kept per request and extended token by
//! token (the prompt, then each accepted token), so a proposal costs a few lookups
//! however long the sequence is.
//!
//! Every n-gram (n = 1..=max_n) gets an id when it first ends somewhere: the id of an
//! n-gram is the id of its first n-1 tokens paired with its last token, so the ids of
//! the n-grams ending at a new position come from the ids ending at the previous one
//! with one exact hash lookup each -- O(max_n) per token and no hashing of whole n-grams.
//! `latest_end[id]` is the latest position where that n-gram ended before the current
//! end.

use std::collections::HashMap;

/// No earlier end recorded for an n-gram.
const NEVER: usize = usize::MAX;
/// The parent id of a 1-gram (the empty prefix).
const EMPTY: u32 = u32::MAX;

/// One request's n-gram index over its known tokens.
#[derive(Debug, Clone)]
pub struct NgramIndex {
    min_n: usize,
    max_n: usize,
    tokens: Vec<u32>,
    /// (id of the n-gram's first n-1 tokens, its last token) → the n-gram's id.
    ids: HashMap<(u32, u32), u32>,
    /// Per n-gram id: its latest end before the current end, or `NEVER`.
    latest_end: Vec<usize>,
    /// `suffix_ids[n - 1]`: the id of the n-gram ending at the current end (as many as
    /// there are tokens, at most max_n).
    suffix_ids: Vec<u32>,
}

impl NgramIndex {
    /// An empty index matching suffixes of `min_n..=max_n` tokens.
    ///
    /// # Panics
    /// When `min_n` is 0 or greater than `max_n`.
    pub fn new(min_n: usize, max_n: usize) -> Self {
        assert!(
            min_n >= 1 && min_n <= max_n,
            "n-gram sizes must satisfy 1 <= min_n <= max_n (got {min_n}..={max_n})"
        );
        Self {
            min_n,
            max_n,
            tokens: Vec::new(),
            ids: HashMap::new(),
            latest_end: Vec::new(),
            suffix_ids: Vec::with_capacity(max_n),
        }
    }

    /// How many tokens the index holds.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Appends `tokens` to the sequence (the prompt first, then generated tokens).
    pub fn extend(&mut self, tokens: &[u32]) {
        for &token in tokens {
            self.push(token);
        }
    }

    fn push(&mut self, token: u32) {
        // The n-grams ending at the old end become earlier occurrences.
        if let Some(old_end) = self.tokens.len().checked_sub(1) {
            for &id in &self.suffix_ids {
                self.latest_end[id as usize] = old_end;
            }
        }
        // The n-gram of n tokens ending here is the (n-1)-gram that ended at the old end
        // followed by `token`; updated in place from the longest down, so each step
        // still reads the old (n-1)-gram.
        let longest = (self.tokens.len() + 1).min(self.max_n);
        self.suffix_ids.resize(longest, EMPTY);
        for n in (1..=longest).rev() {
            let parent = if n == 1 {
                EMPTY
            } else {
                self.suffix_ids[n - 2]
            };
            let fresh = self.latest_end.len() as u32;
            let id = *self.ids.entry((parent, token)).or_insert(fresh);
            if id == fresh {
                self.latest_end.push(NEVER);
            }
            self.suffix_ids[n - 1] = id;
        }
        self.tokens.push(token);
    }

    /// Up to `k` tokens that followed the latest earlier occurrence of the sequence's
    /// last n tokens, trying n from max_n down to min_n (fewer than `k` when that
    /// occurrence is near the end; empty when no suffix occurred before).
    pub fn propose(&self, k: usize) -> Vec<u32> {
        if k == 0 {
            return Vec::new();
        }
        let longest = self.suffix_ids.len();
        for n in (self.min_n..=longest).rev() {
            let end = self.latest_end[self.suffix_ids[n - 1] as usize];
            if end != NEVER {
                let from = end + 1;
                let to = (from + k).min(self.tokens.len());
                return self.tokens[from..to].to_vec();
            }
        }
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// The definition, searched directly: for n from max_n down, the latest end e
    /// before the last position whose n tokens equal the last n tokens.
    fn brute_force(tokens: &[u32], min_n: usize, max_n: usize, k: usize) -> Vec<u32> {
        let len = tokens.len();
        for n in (min_n..=max_n.min(len)).rev() {
            let suffix = &tokens[len - n..];
            for end in (n - 1..len - 1).rev() {
                if &tokens[end + 1 - n..=end] == suffix {
                    return tokens[end + 1..(end + 1 + k).min(len)].to_vec();
                }
            }
        }
        Vec::new()
    }

    #[test]
    fn matches_a_brute_force_search_on_random_sequences() {
        let mut rng = StdRng::seed_from_u64(17);
        for case in 0..400 {
            let min_n = rng.random_range(1..=3);
            let max_n = rng.random_range(min_n..=5);
            // Small alphabets repeat n-grams often; larger ones rarely.
            let alphabet = rng.random_range(2..=12);
            let len = rng.random_range(0..120);
            let mut index = NgramIndex::new(min_n, max_n);
            let mut tokens = Vec::new();
            while tokens.len() < len {
                let chunk: Vec<u32> = (0..rng.random_range(1..=6))
                    .map(|_| rng.random_range(0..alphabet))
                    .collect();
                index.extend(&chunk);
                tokens.extend_from_slice(&chunk);
                for k in [1, 3, 8] {
                    assert_eq!(
                        index.propose(k),
                        brute_force(&tokens, min_n, max_n, k),
                        "case {case}: n {min_n}..={max_n}, k {k}, tokens {tokens:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn incremental_extension_equals_one_built_from_the_whole_sequence() {
        let mut rng = StdRng::seed_from_u64(5);
        for _ in 0..100 {
            let tokens: Vec<u32> = (0..rng.random_range(1..200))
                .map(|_| rng.random_range(0..4))
                .collect();
            let mut one_by_one = NgramIndex::new(1, 4);
            for &t in &tokens {
                one_by_one.extend(&[t]);
            }
            let mut whole = NgramIndex::new(1, 4);
            whole.extend(&tokens);
            assert_eq!(one_by_one.len(), tokens.len());
            assert_eq!(one_by_one.latest_end, whole.latest_end);
            assert_eq!(one_by_one.suffix_ids, whole.suffix_ids);
            for k in 0..6 {
                assert_eq!(one_by_one.propose(k), whole.propose(k));
            }
        }
    }

    #[test]
    fn the_longest_matching_suffix_wins_over_a_later_shorter_one() {
        let mut index = NgramIndex::new(1, 3);
        // "1 2 3" occurred once early (followed by 10 11); "3" alone occurred later
        // (followed by 20).
        index.extend(&[1, 2, 3, 10, 11, 3, 20, 1, 2, 3]);
        assert_eq!(index.propose(2), vec![10, 11]);
        // Limited to 2-grams, "2 3" gives the same early occurrence.
        let mut pairs = NgramIndex::new(1, 2);
        pairs.extend(&[1, 2, 3, 10, 11, 3, 20, 1, 2, 3]);
        assert_eq!(pairs.propose(2), vec![10, 11]);
        // With 1-grams only, the latest "3" wins.
        let mut singles = NgramIndex::new(1, 1);
        singles.extend(&[1, 2, 3, 10, 11, 3, 20, 1, 2, 3]);
        assert_eq!(singles.propose(2), vec![20, 1]);
    }

    #[test]
    fn at_equal_length_the_latest_occurrence_wins() {
        let mut index = NgramIndex::new(2, 2);
        index.extend(&[5, 6, 7, 5, 6, 8, 5, 6]);
        assert_eq!(index.propose(1), vec![8]);
    }

    #[test]
    fn proposals_stop_at_the_end_of_the_sequence_and_need_min_n() {
        let mut index = NgramIndex::new(2, 4);
        index.extend(&[9, 9, 9]);
        // "9 9 9" does not occur earlier; "9 9" ended at position 1: followed by one
        // token only.
        assert_eq!(index.propose(4), vec![9]);
        let mut index = NgramIndex::new(2, 4);
        index.extend(&[1, 2, 3, 1]);
        // Only a 1-gram repeats, below min_n.
        assert!(index.propose(4).is_empty());
        assert!(NgramIndex::new(1, 1).propose(3).is_empty());
        let mut index = NgramIndex::new(1, 1);
        index.extend(&[4, 4]);
        assert!(index.propose(0).is_empty());
    }
}
