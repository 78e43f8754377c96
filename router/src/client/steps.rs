//! Steps travel on one bidirectional stream per rank (`Shard.Steps`), so they reach each
//! shard in the order they were written: a step sent while the one before it runs is
//! queued right behind it on the shard. The answers come back in the same order, each
//! naming its step.
//!
//! A stream is a session: opening one makes the shard drop every request's state. A
//! session ends when one of its steps fails (an error answer from any rank, a broken
//! stream, ranks that disagree) or is abandoned after it was written, or on
//! `end_session`; the next step opens a new one, on every rank. Steps already written
//! still get their answers.
//!
//! A step is written when it is handed over (`Steps::submit`), so the caller's order is
//! the order on the streams: the batching loop hands steps over in step_id order. A step
//! out of that order is answered by the shard with an error and not run.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use futures::future::try_join_all;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::transport::Channel;

use super::{shard_error, Grpc};
use crate::error::ShardError;
use crate::pb;

type Answer = Result<pb::StepResponse, ShardError>;

/// Where each rank's answer to one step arrives, rank 0 first.
type AnswerSenders = Vec<oneshot::Sender<Answer>>;

/// The steps of every rank, one session at a time.
pub(super) struct Steps {
    ranks: Vec<Grpc<Channel>>,
    session: Mutex<Session>,
}

#[derive(Default)]
struct Session {
    /// Counts the sessions, so that a failure reported late ends only its own.
    epoch: u64,
    /// One per rank, rank 0 first; empty until the session's first step is written.
    streams: Vec<RankStream>,
}

/// A step handed over: where its answers arrive. Dropped before its answers came (the
/// loop abandoned it), it ends its session: what it did on the shards is unknown.
pub(super) struct Submitted {
    steps: Arc<Steps>,
    pub(super) epoch: u64,
    step_id: u64,
    answers: Vec<oneshot::Receiver<Answer>>,
    /// Its answers came.
    settled: bool,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing panics while holding these locks; a poisoned one is still consistent.
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

impl Steps {
    pub(super) fn new(ranks: Vec<Grpc<Channel>>) -> Self {
        Self {
            ranks,
            session: Mutex::default(),
        }
    }

    /// Hands a step over: written now on every rank's stream (opened first when this is
    /// the session's first step).
    pub(super) fn submit(self: &Arc<Self>, request: pb::StepRequest) -> Submitted {
        let step_id = request.step_id;
        let (senders, answers): (AnswerSenders, Vec<_>) =
            self.ranks.iter().map(|_| oneshot::channel()).unzip();
        let mut session = lock(&self.session);
        session.write(&self.ranks, request, senders);
        Submitted {
            steps: self.clone(),
            epoch: session.epoch,
            step_id,
            answers,
            settled: false,
        }
    }

    /// Ends the session `epoch` (any session with None): the next step opens a new one.
    pub(super) fn end_session(&self, epoch: Option<u64>, why: &str) {
        let mut session = lock(&self.session);
        if epoch.is_none_or(|e| e == session.epoch) {
            session.end(why);
        }
    }
}

impl Session {
    /// Makes way for a new session, opened by the next step. Dropping the streams ends
    /// them once the steps written are answered.
    fn end(&mut self, why: &str) {
        tracing::debug!(epoch = self.epoch, why, "step session ended");
        *self = Session {
            epoch: self.epoch + 1,
            ..Session::default()
        };
    }

    fn write(&mut self, ranks: &[Grpc<Channel>], request: pb::StepRequest, senders: AnswerSenders) {
        if self.streams.is_empty() {
            self.streams = ranks
                .iter()
                .enumerate()
                .map(|(rank, grpc)| RankStream::open(rank, grpc.clone()))
                .collect();
        }
        let (last, others) = self.streams.split_last().expect("at least one rank");
        let mut senders = senders.into_iter();
        for stream in others {
            stream.write(
                request.clone(),
                senders.next().expect("one sender per rank"),
            );
        }
        last.write(request, senders.next().expect("one sender per rank"));
    }
}

impl Submitted {
    /// Every rank's answer, rank 0 first; the first failure as soon as it comes.
    pub(super) async fn answers(mut self) -> Result<Vec<pb::StepResponse>, ShardError> {
        let receivers = std::mem::take(&mut self.answers);
        let answers = try_join_all(receivers.into_iter().enumerate().map(
            |(rank, answer)| async move {
                answer.await.unwrap_or_else(|_| {
                    Err(ShardError {
                        rank,
                        message: "the step's answer was dropped".into(),
                    })
                })
            },
        ))
        .await;
        self.settled = true;
        answers
    }
}

impl Drop for Submitted {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        let mut session = lock(&self.steps.session);
        if session.epoch == self.epoch {
            let why = format!("step {} was abandoned before its answer", self.step_id);
            session.end(&why);
        }
    }
}

/// One rank's stream: the steps written to it, and the steps waiting for its answer.
struct RankStream {
    requests: mpsc::UnboundedSender<pb::StepRequest>,
    waiting: Arc<Mutex<Waiting>>,
}

#[derive(Default)]
struct Waiting {
    answers: HashMap<u64, oneshot::Sender<Answer>>,
    /// Why the stream ended; a step written after that fails with it at once.
    ended: Option<ShardError>,
}

impl RankStream {
    /// Opens the stream; a task of its own reads the answers.
    fn open(rank: usize, grpc: Grpc<Channel>) -> Self {
        let (requests, outbox) = mpsc::unbounded_channel();
        let waiting = Arc::new(Mutex::new(Waiting::default()));
        tokio::spawn(read_answers(rank, grpc, outbox, waiting.clone()));
        Self { requests, waiting }
    }

    fn write(&self, request: pb::StepRequest, answer: oneshot::Sender<Answer>) {
        let mut waiting = lock(&self.waiting);
        if let Some(why) = &waiting.ended {
            let _ = answer.send(Err(why.clone()));
            return;
        }
        waiting.answers.insert(request.step_id, answer);
        // Should the stream be gone already, its reader fails `answer` as it ends.
        let _ = self.requests.send(request);
    }
}

impl Waiting {
    fn deliver(&mut self, rank: usize, answer: pb::StepAnswer) {
        let Some(sender) = self.answers.remove(&answer.step_id) else {
            return; // the loop abandoned that step
        };
        use pb::step_answer::Outcome;
        let _ = sender.send(match answer.outcome {
            Some(Outcome::Response(response)) => Ok(response),
            Some(Outcome::Error(message)) => Err(ShardError { rank, message }),
            None => Err(ShardError {
                rank,
                message: format!("step {}: an answer without an outcome", answer.step_id),
            }),
        });
    }

    fn end(&mut self, why: ShardError) {
        for (_, sender) in self.answers.drain() {
            let _ = sender.send(Err(why.clone()));
        }
        self.ended = Some(why);
    }
}

async fn read_answers(
    rank: usize,
    mut grpc: Grpc<Channel>,
    outbox: mpsc::UnboundedReceiver<pb::StepRequest>,
    waiting: Arc<Mutex<Waiting>>,
) {
    let why = match grpc.steps(UnboundedReceiverStream::new(outbox)).await {
        Err(status) => shard_error(rank, status),
        Ok(answers) => {
            let mut answers = answers.into_inner();
            loop {
                match answers.message().await {
                    Ok(Some(answer)) => lock(&waiting).deliver(rank, answer),
                    Ok(None) => {
                        break ShardError {
                            rank,
                            message: "the shard ended the step stream".into(),
                        }
                    }
                    Err(status) => break shard_error(rank, status),
                }
            }
        }
    };
    lock(&waiting).end(why);
}
