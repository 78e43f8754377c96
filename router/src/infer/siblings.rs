//! A request's samples (`best_of` / `n` of them): each is its own sequence with its own
//! seed; the first is queued, the others wait (`Sibling`) until it has computed the
//! prompt and then fork from it, sharing its KV blocks copy-on-write. The request book
//! (`book`) creates and starts them.

use super::entry::Entry;
use crate::scheduler::Sequence;

/// A sample 1.. of a `best_of` request, held until sample 0 has computed the prompt.
pub(super) struct Sibling {
    pub seq: Sequence,
    pub entry: Entry,
}

/// The seed of sample `index` of a request: the request's own for the first, then
/// distinct ones derived from it (SplitMix64), so a seeded request is reproducible.
pub(super) fn sample_seed(seed: u64, index: usize) -> u64 {
    if index == 0 {
        return seed;
    }
    let mut z = seed.wrapping_add((index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
