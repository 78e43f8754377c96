//! The one client for all shards. Every call goes to every rank concurrently; rank 0's
//! answer is used (all ranks compute the same thing) and any rank's failure fails the call.
//! With `check_agreement` (a debug flag) every rank's Step answer is compared with rank 0's.
//! Steps travel on one stream per rank (`steps`). Shards listen on unix sockets.

mod steps;

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use futures::future::try_join_all;
use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::error::{RouterError, ShardError};
use crate::pb;
use crate::pb::shard_client::ShardClient as Grpc;
use steps::Steps;

/// Largest message either way (long prompts travel in `NewRequest.token_ids`).
const MAX_MESSAGE_BYTES: usize = 256 << 20;

/// What the batching loop needs from the shards; a fake implements it in tests.
pub trait Backend: Send + Sync + 'static {
    /// Sends one step; the returned future is its answer. The step is handed to the
    /// shards by this call, not when the future is first polled, so steps called in
    /// step_id order run in that order, each right behind the one before it: a step may be
    /// sent while the one before it runs. A failed step ends the shards' session (so does
    /// a step abandoned unanswered after it was sent): from the next step on they hold no
    /// request.
    fn step(
        &self,
        request: pb::StepRequest,
    ) -> impl Future<Output = Result<pb::StepResponse, ShardError>> + Send + 'static;
    /// Ends the shards' session: from the next step on they hold no request (their KV
    /// blocks stay allocated). The loop calls it when it has forgotten every request.
    fn end_session(&self);
}

/// A shard group's `Health` answers together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardHealth {
    /// Every rank has allocated its KV cache.
    pub ready: bool,
    /// The ranks' forward heartbeats added up: grows while a forward makes progress.
    pub heartbeats: u64,
}

#[derive(Clone)]
pub struct ShardClient {
    ranks: Vec<Grpc<Channel>>,
    steps: Arc<Steps>,
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
                    // a refused connect costs microseconds: poll often, the shard is ready
                    // when its socket is
                    Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
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
            steps: Arc::new(Steps::new(ranks.clone())),
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

    /// Each rank's gRPC client, rank 0 first (the adapter calls, `lora::shards`).
    pub(crate) fn ranks(&self) -> &[Grpc<Channel>] {
        &self.ranks
    }

    /// Calls every rank at once; their answers, rank 0 first, or the first failure.
    async fn every_rank<T, F, Fut>(&self, call: F) -> Result<Vec<T>, ShardError>
    where
        F: Fn(Grpc<Channel>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        try_join_all(self.ranks.iter().enumerate().map(|(rank, c)| {
            let answer = call(c.clone());
            async move {
                answer
                    .await
                    .map(tonic::Response::into_inner)
                    .map_err(|s| shard_error(rank, s))
            }
        }))
        .await
    }

    /// Every rank's `Info`, rank 0 first.
    pub async fn info(&self) -> Result<Vec<pb::InfoResponse>, ShardError> {
        self.every_rank(|mut c| async move { c.info(pb::InfoRequest {}).await })
            .await
    }

    /// Every rank's `Warmup`, rank 0 first. All ranks at once: tensor-parallel ranks
    /// profile together and agree on their number of blocks.
    pub async fn warmup(
        &self,
        request: pb::WarmupRequest,
    ) -> Result<Vec<pb::WarmupResponse>, ShardError> {
        self.every_rank(|mut c| async move { c.warmup(request).await })
            .await
    }

    /// True when every rank answers and is ready.
    pub async fn health(&self) -> Result<ShardHealth, ShardError> {
        let answers = self
            .every_rank(|mut c| async move { c.health(pb::HealthRequest {}).await })
            .await?;
        Ok(ShardHealth {
            ready: answers.iter().all(|h| h.ready),
            heartbeats: answers.iter().map(|h| h.heartbeats).sum(),
        })
    }

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
    /// The step is handed over to the streams when this is called, not when the future
    /// is first polled: steps called in step_id order are written in that order.
    fn step(
        &self,
        request: pb::StepRequest,
    ) -> impl Future<Output = Result<pb::StepResponse, ShardError>> + Send + 'static {
        let submitted = self.steps.submit(request);
        let steps = self.steps.clone();
        let check = self.check_agreement;
        async move {
            let epoch = submitted.epoch;
            let answer = submitted.answers().await.and_then(|mut answers| {
                if check {
                    check_agreement(&answers)?;
                }
                Ok(answers.swap_remove(0))
            });
            if let Err(e) = &answer {
                steps.end_session(Some(epoch), &e.to_string());
            }
            answer
        }
    }

    fn end_session(&self) {
        self.steps.end_session(None, "ended by the router");
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
