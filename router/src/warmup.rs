//! Warm-up, at start: every rank profiles the largest step it will get and allocates its
//! KV cache; the router's block accounting uses the smallest cache of all ranks.

use crate::args::KvCache;
use crate::client::ShardClient;
use crate::error::ShardError;
use crate::pb;

const MIB: f64 = (1 << 20) as f64;

/// Warms every rank up at once (tensor-parallel ranks profile together and agree on a
/// number of blocks) and logs the capacity and each rank's memory.
pub async fn warm_up(
    shards: &ShardClient,
    request: pb::WarmupRequest,
) -> Result<KvCache, ShardError> {
    let warmups = shards.warmup(request).await?;
    let cache = smallest(&warmups);
    tracing::info!(
        num_blocks = cache.num_blocks,
        block_size = cache.block_size,
        tokens = cache.num_blocks * cache.block_size,
        "KV cache"
    );
    for (rank, w) in warmups.iter().enumerate() {
        tracing::info!(
            rank,
            weights_mib = %format!("{:.1}", w.weight_bytes as f64 / MIB),
            activations_mib = %format!("{:.1}", w.activation_bytes as f64 / MIB),
            kv_cache_mib = %format!("{:.1}", w.kv_cache_bytes as f64 / MIB),
            kib_per_block = w.bytes_per_block / 1024,
            "shard memory"
        );
    }
    Ok(cache)
}

/// The cache every rank can hold: the fewest blocks (rank 0's block size; `Info` checked
/// that the ranks agree on it).
fn smallest(warmups: &[pb::WarmupResponse]) -> KvCache {
    KvCache {
        num_blocks: warmups.iter().map(|w| w.num_blocks).min().unwrap_or(0) as usize,
        block_size: warmups[0].block_size as usize,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_smallest_rank_sets_the_number_of_blocks() {
        let warmup = |num_blocks| pb::WarmupResponse {
            num_blocks,
            block_size: 16,
            ..Default::default()
        };
        let cache = smallest(&[warmup(120), warmup(96), warmup(130)]);
        assert_eq!(
            cache,
            KvCache {
                num_blocks: 96,
                block_size: 16
            }
        );
    }
}
