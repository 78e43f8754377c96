//! The one client for all shards. Every call goes to every rank concurrently; rank 0's
//! answer is used (all ranks compute the same thing) and any rank's failure fails the call.
//! With `check_agreement` (a debug flag) every rank's Step answer is compared with rank 0's.
//! Shards listen on unix sockets.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Duration;

use futures::future::try_join_all;
use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::error::{RouterError, ShardError};
use crate::pb;
use crate::pb::shard_client::ShardClient as Grpc;

/// Largest message either way (long prompts travel in `NewRequest.token_ids`).
const MAX_MESSAGE_BYTES: usize = 256 << 20;

/// What the batching loop needs from the shards; a fake implements it in tests.
pub trait Backend: Send + Sync + 'static {
    fn step(
        &self,
        request: pb::StepRequest,
    ) -> impl Future<Output = Result<pb::StepResponse, ShardError>> + Send;
    fn clear_cache(&self) -> impl Future<Output = Result<(), ShardError>> + Send;
}

#[derive(Clone)]
pub struct ShardClient {
    ranks: Vec<Grpc<Channel>>,
    check_agreement: bool,
}

fn shard_error(rank: usize, status: tonic::Status) -> ShardError {
    ShardError {
        rank,
        message: format!("{:?}: {}", status.code(), status.message()),
    }
}

async fn connect_uds(path: &Path) -> Result<Channel, tonic::transport::Error> {
    let path: PathBuf = path.to_path_buf();
    // The URI is required by the API but unused: the connector dials the socket.
    Endpoint::from_static("http://[::]:50051")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(path).await?)) }
        }))
        .await
}

/// Every rank must have sampled the same tokens with the same logprobs as rank 0.
pub fn check_agreement(answers: &[pb::StepResponse]) -> Result<(), ShardError> {
    let first = &answers[0].generations;
    for (rank, answer) in answers.iter().enumerate().skip(1) {
        if answer.generations != *first {
            let ids = |g: &[pb::Generation]| -> Vec<(u64, Vec<u32>)> {
                g.iter().map(|g| (g.id, g.token_ids.clone())).collect()
            };
            return Err(ShardError {
                rank,
                message: format!(
                    "rank {rank} disagrees with rank 0: (request, tokens) {:?} != {:?}",
                    ids(&answer.generations),
                    ids(first)
                ),
            });
        }
    }
    Ok(())
}

impl ShardClient {
    /// Connects to every rank, retrying for `wait` while the sockets appear.
    pub async fn connect(paths: &[PathBuf], wait: Duration) -> Result<Self, RouterError> {
        let deadline = tokio::time::Instant::now() + wait;
        let mut ranks = Vec::with_capacity(paths.len());
        for (rank, path) in paths.iter().enumerate() {
            let channel = loop {
                match connect_uds(path).await {
                    Ok(channel) => break channel,
                    Err(e) if tokio::time::Instant::now() >= deadline => {
                        return Err(RouterError::Connect {
                            rank,
                            path: path.display().to_string(),
                            message: format!("{e:?}"),
                        })
                    }
                    Err(_) => tokio::time::sleep(Duration::from_millis(250)).await,
                }
            };
            tracing::info!(rank, path = %path.display(), "connected to shard");
            ranks.push(
                Grpc::new(channel)
                    .max_decoding_message_size(MAX_MESSAGE_BYTES)
                    .max_encoding_message_size(MAX_MESSAGE_BYTES),
            );
        }
        Ok(Self {
            ranks,
            check_agreement: false,
        })
    }

    /// Compare every rank's Step answer with rank 0's (debug).
    pub fn with_agreement_check(mut self, on: bool) -> Self {
        self.check_agreement = on;
        self
    }

    pub fn world_size(&self) -> usize {
        self.ranks.len()
    }

    /// Every rank's `Info`, rank 0 first.
    pub async fn info(&self) -> Result<Vec<pb::InfoResponse>, ShardError> {
        try_join_all(self.ranks.iter().enumerate().map(|(rank, c)| {
            let mut c = c.clone();
            async move {
                c.info(pb::InfoRequest {})
                    .await
                    .map(|r| r.into_inner())
                    .map_err(|s| shard_error(rank, s))
            }
        }))
        .await
    }

    /// True when every rank answers and is ready.
    pub async fn health(&self) -> Result<bool, ShardError> {
        let answers = try_join_all(self.ranks.iter().enumerate().map(|(rank, c)| {
            let mut c = c.clone();
            async move {
                c.health(pb::HealthRequest {})
                    .await
                    .map(|r| r.into_inner().ready)
                    .map_err(|s| shard_error(rank, s))
            }
        }))
        .await?;
        Ok(answers.into_iter().all(|ready| ready))
    }
}

impl ShardClient {
    /// Rank 0's cumulative (computed tokens, prompt tokens computed).
    pub async fn computed_tokens(&self) -> Result<(u64, u64), ShardError> {
        let mut c = self.ranks[0].clone();
        let r = c
            .health(pb::HealthRequest {})
            .await
            .map_err(|s| shard_error(0, s))?
            .into_inner();
        Ok((r.computed_tokens_total, r.prompt_tokens_computed_total))
    }
}

impl Backend for ShardClient {
    async fn step(&self, request: pb::StepRequest) -> Result<pb::StepResponse, ShardError> {
        let last = self.ranks.len() - 1;
        let mut request = Some(request);
        let calls = self.ranks.iter().enumerate().map(|(rank, c)| {
            let mut c = c.clone();
            // Every rank but the last gets a copy; the last takes the original.
            let r = if rank == last {
                request.take().expect("one request per rank")
            } else {
                request.clone().expect("one request per rank")
            };
            async move {
                c.step(r)
                    .await
                    .map(|r| r.into_inner())
                    .map_err(|s| shard_error(rank, s))
            }
        });
        let mut answers = try_join_all(calls.collect::<Vec<_>>()).await?;
        if self.check_agreement {
            check_agreement(&answers)?;
        }
        Ok(answers.swap_remove(0))
    }

    async fn clear_cache(&self) -> Result<(), ShardError> {
        try_join_all(self.ranks.iter().enumerate().map(|(rank, c)| {
            let mut c = c.clone();
            async move {
                c.clear_cache(pb::ClearCacheRequest {})
                    .await
                    .map(|_| ())
                    .map_err(|s| shard_error(rank, s))
            }
        }))
        .await?;
        Ok(())
    }
}

#[cfg(test)]
mod agreement_tests {
    use super::*;

    fn answer(token: u32, logprob: f32) -> pb::StepResponse {
        pb::StepResponse {
            generations: vec![pb::Generation {
                id: 7,
                token_ids: vec![token],
                logprobs: vec![logprob],
                ..Default::default()
            }],
            computed_tokens: 1,
            ..Default::default()
        }
    }

    #[test]
    fn ranks_that_agree_pass_even_with_different_timings() {
        let mut other = answer(3, -0.5);
        other.forward_ns = 99;
        assert!(check_agreement(&[answer(3, -0.5), other]).is_ok());
    }

    #[test]
    fn a_rank_with_another_token_or_logprob_fails_the_step() {
        let err = check_agreement(&[answer(3, -0.5), answer(3, -0.5), answer(4, -0.5)])
            .expect_err("rank 2 sampled another token");
        assert_eq!(err.rank, 2);
        assert!(err.message.contains("rank 2 disagrees"), "{}", err.message);
        assert!(check_agreement(&[answer(3, -0.5), answer(3, -0.25)]).is_err());
    }
}
