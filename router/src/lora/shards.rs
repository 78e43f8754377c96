//! The shards' side of a host load: `LoadAdapter` on every rank of every replica at once
//! (each rank parses its slice; the router keeps the most blocks any rank needs), and
//! `DropAdapter` when the router forgets an adapter. A load refused anywhere is dropped
//! everywhere it succeeded, so an adapter is never half-loaded.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use futures::future::{join_all, try_join_all};

use crate::client::ShardClient;
use crate::pb;

/// An answer from the shards; Err holds what went wrong, in words.
pub type Reply<T> = Pin<Box<dyn Future<Output = Result<T, String>> + Send>>;

/// One shard group's adapter calls (the batching loop's `Backend` carries the steps).
pub trait AdapterShards: Send + Sync + 'static {
    /// `LoadAdapter` on every rank of the group at once: their answers, rank 0 first, or
    /// the first refusal's message.
    fn load_adapter(&self, name: &str, path: &str) -> Reply<Vec<pb::LoadAdapterResponse>>;
    /// `DropAdapter` on every rank of the group.
    fn drop_adapter(&self, name: &str) -> Reply<()>;
}

/// What a host load tells the router about an adapter (over every rank of every replica).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostAdapter {
    /// KV-pool blocks it takes when paged in: the most any rank needs.
    pub num_blocks: usize,
    pub max_rank: u32,
    pub target_modules: Vec<String>,
    /// Its weights' bytes on the rank that holds the most.
    pub bytes: u64,
}

/// A refusal's words: an INVALID_ARGUMENT is the shard's own reason (it names what and
/// why); anything else says which rank and what failed.
fn refusal(rank: usize, status: tonic::Status) -> String {
    match status.code() {
        tonic::Code::InvalidArgument => status.message().to_string(),
        code => format!("shard {rank}: {code:?}: {}", status.message()),
    }
}

impl AdapterShards for ShardClient {
    fn load_adapter(&self, name: &str, path: &str) -> Reply<Vec<pb::LoadAdapterResponse>> {
        let request = pb::LoadAdapterRequest {
            name: name.to_string(),
            path: path.to_string(),
        };
        let ranks = self.ranks().to_vec();
        Box::pin(async move {
            try_join_all(ranks.into_iter().enumerate().map(|(rank, mut c)| {
                let request = request.clone();
                async move {
                    c.load_adapter(request)
                        .await
                        .map(tonic::Response::into_inner)
                        .map_err(|s| refusal(rank, s))
                }
            }))
            .await
        })
    }

    fn drop_adapter(&self, name: &str) -> Reply<()> {
        let request = pb::DropAdapterRequest {
            name: name.to_string(),
        };
        let ranks = self.ranks().to_vec();
        Box::pin(async move {
            try_join_all(ranks.into_iter().enumerate().map(|(rank, mut c)| {
                let request = request.clone();
                async move {
                    c.drop_adapter(request)
                        .await
                        .map(|_| ())
                        .map_err(|s| refusal(rank, s))
                }
            }))
            .await
            .map(|_| ())
        })
    }
}

/// Loads adapter `name` from `path` on every rank of every group at once. On a refusal
/// anywhere, the groups that loaded it drop it again and the first refusal is returned.
pub async fn load_everywhere(
    groups: &[Arc<dyn AdapterShards>],
    name: &str,
    path: &str,
) -> Result<HostAdapter, String> {
    let answers = join_all(groups.iter().map(|g| g.load_adapter(name, path))).await;
    if let Some(Err(why)) = answers.iter().find(|a| a.is_err()) {
        let why = why.clone();
        let loaded = groups
            .iter()
            .zip(&answers)
            .filter(|(_, a)| a.is_ok())
            .map(|(g, _)| g.drop_adapter(name));
        for dropped in join_all(loaded).await {
            if let Err(e) = dropped {
                tracing::warn!(adapter = name, error = %e, "dropping a half-loaded adapter failed");
            }
        }
        return Err(why);
    }
    let ranks: Vec<pb::LoadAdapterResponse> =
        answers.into_iter().flat_map(Result::unwrap).collect();
    let mut host = HostAdapter {
        num_blocks: 0,
        max_rank: 0,
        target_modules: Vec::new(),
        bytes: 0,
    };
    for r in ranks {
        host.num_blocks = host.num_blocks.max(r.num_blocks as usize);
        host.max_rank = host.max_rank.max(r.max_rank);
        host.bytes = host.bytes.max(r.bytes);
        for m in r.target_modules {
            if !host.target_modules.contains(&m) {
                host.target_modules.push(m);
            }
        }
    }
    Ok(host)
}

/// Drops adapter `name` on every group; failures are logged (a shard that lost it
/// already holds nothing to free).
pub async fn drop_everywhere(groups: &[Arc<dyn AdapterShards>], name: &str) {
    for dropped in join_all(groups.iter().map(|g| g.drop_adapter(name))).await {
        if let Err(e) = dropped {
            tracing::warn!(adapter = name, error = %e, "DropAdapter failed");
        }
    }
}
