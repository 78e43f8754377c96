//! Warm-up, at start: every rank profiles the largest step it will get and allocates its
//! KV cache; the router's block accounting uses the smallest cache of all ranks.
//!
//! Replicas (`--replicas`) share the machine: the first is warmed up with its share of
//! `--memory-fraction` (the shard divides it by the number of replicas), the others are
//! given the very KV cache size in bytes it got, so every replica holds as many blocks.

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
    Ok(warm_up_group(shards, request).await?.0)
}

/// Warms the replicas up one after the other (see the module documentation); returns
/// each one's cache, in replica order.
pub async fn warm_up_replicas(
    replicas: &[ShardClient],
    mut request: pb::WarmupRequest,
) -> Result<Vec<KvCache>, ShardError> {
    request.replicas = replicas.len() as u32;
    let mut caches = Vec::with_capacity(replicas.len());
    for (i, shards) in replicas.iter().enumerate() {
        tracing::info!(replica = i, "warming up");
        let (cache, kv_bytes) = warm_up_group(shards, request).await?;
        request.kv_cache_bytes = kv_bytes;
        caches.push(cache);
    }
    Ok(caches)
}

/// Warms one shard group up; returns its cache and the KV bytes its smallest rank holds.
async fn warm_up_group(
    shards: &ShardClient,
    request: pb::WarmupRequest,
) -> Result<(KvCache, u64), ShardError> {
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
    let kv_bytes = warmups
        .iter()
        .map(|w| u64::from(w.num_blocks) * w.bytes_per_block)
        .min()
        .unwrap_or(0);
    Ok((cache, kv_bytes))
}

/// The cache every rank can hold: the fewest blocks and host blocks (rank 0's block size;
/// `Info` checked that the ranks agree on it).
fn smallest(warmups: &[pb::WarmupResponse]) -> KvCache {
    let fewest = |blocks: fn(&pb::WarmupResponse) -> u32| {
        warmups.iter().map(blocks).min().unwrap_or(0) as usize
    };
    KvCache {
        num_blocks: fewest(|w| w.num_blocks),
        block_size: warmups[0].block_size as usize,
        host_blocks: fewest(|w| w.host_blocks),
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
            host_blocks: 4 * num_blocks,
            ..Default::default()
        };
        let cache = smallest(&[warmup(120), warmup(96), warmup(130)]);
        assert_eq!(
            cache,
            KvCache {
                num_blocks: 96,
                block_size: 16,
                host_blocks: 384,
            }
        );
    }
}
