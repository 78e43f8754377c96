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
//! Steps are written in step_id order. The batching loop hands each step over from a task
//! of its own, so a step sent ahead may be handed over before the one it follows; it is
//! held until that one is written (`Order`). The first step of a session is written as it
//! comes: nothing tells which id a session starts from.

use std::collections::{BTreeMap, HashMap};
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
    order: Order<(pb::StepRequest, AnswerSenders)>,
}

/// A step handed over: where its answers arrive. Dropped before its answers came (the
/// loop abandoned it), a step still held is never written, and a step written ends its
/// session: what it did on the shards is unknown.
pub(super) struct Submitted {
    steps: Arc<Steps>,
    pub(super) epoch: u64,
    step_id: u64,
    answers: Vec<oneshot::Receiver<Answer>>,
    /// Answered already (its answers came, or it was refused without being written).
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

    /// Hands a step over: written now on every rank's stream, followed by the held steps
    /// it unblocks, or held until the step before it is written. A step whose id is not
    /// after the last one written is answered with an error.
    pub(super) fn submit(self: &Arc<Self>, request: pb::StepRequest) -> Submitted {
        let step_id = request.step_id;
        let (senders, answers): (AnswerSenders, Vec<_>) =
            self.ranks.iter().map(|_| oneshot::channel()).unzip();
        let mut session = lock(&self.session);
        let settled = match session.order.hand_over(step_id, (request, senders)) {
            Ok(ready) => {
                for (request, senders) in ready {
                    session.write(&self.ranks, request, senders);
                }
                false
            }
            Err((last, (_, senders))) => {
                let message =
                    format!("step {step_id} was handed over after step {last} had been sent");
                fail(senders, &message);
                true
            }
        };
        Submitted {
            steps: self.clone(),
            epoch: session.epoch,
            step_id,
            answers,
            settled,
        }
    }

    /// Ends the session `epoch` (any session with None): the next step opens a new one.
    /// Its held steps fail with `why`.
    pub(super) fn end_session(&self, epoch: Option<u64>, why: &str) {
        let mut session = lock(&self.session);
        if epoch.is_none_or(|e| e == session.epoch) {
            session.end(why);
        }
    }
}

fn fail(senders: AnswerSenders, message: &str) {
    for (rank, sender) in senders.into_iter().enumerate() {
        let _ = sender.send(Err(ShardError {
            rank,
            message: message.to_string(),
        }));
    }
}

impl Session {
    /// Makes way for a new session, opened by the next step; the held steps fail with
    /// `why`. Dropping the streams ends them once the steps written are answered.
    fn end(&mut self, why: &str) {
        let next = Session {
            epoch: self.epoch + 1,
            ..Session::default()
        };
        let ended = std::mem::replace(self, next);
        for (request, senders) in ended.order.held.into_values() {
            let message = format!("step {}: its session ended: {why}", request.step_id);
            fail(senders, &message);
        }
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
        if session.epoch == self.epoch && !session.order.forget(self.step_id) {
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

/// Puts steps in step_id order: each is written right after the one before it.
struct Order<T> {
    last_written: Option<u64>,
    /// Steps handed over before the step they follow was written.
    held: BTreeMap<u64, T>,
}

impl<T> Default for Order<T> {
    fn default() -> Self {
        Self {
            last_written: None,
            held: BTreeMap::new(),
        }
    }
}

impl<T> Order<T> {
    /// Takes the step `step_id`; returns the steps to write now, in order: it and the held
    /// steps it unblocks, or none while the step before it has not come. A step not
    /// after the last one written comes back with that one's id.
    fn hand_over(&mut self, step_id: u64, step: T) -> Result<Vec<T>, (u64, T)> {
        let next = match self.last_written {
            Some(last) if step_id <= last => return Err((last, step)),
            Some(last) => last + 1,
            None => step_id, // the session's first step
        };
        if step_id != next {
            self.held.insert(step_id, step);
            return Ok(Vec::new());
        }
        let mut ready = vec![step];
        let mut last = step_id;
        while let Some(held) = self.held.remove(&(last + 1)) {
            ready.push(held);
            last += 1;
        }
        self.last_written = Some(last);
        Ok(ready)
    }

    /// Drops a held step (its answer is no longer awaited); false when it is not held.
    fn forget(&mut self, step_id: u64) -> bool {
        self.held.remove(&step_id).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::Order;

    #[test]
    fn the_first_step_opens_the_order_and_each_next_one_is_written_at_once() {
        let mut order = Order::default();
        assert_eq!(order.hand_over(17, "a"), Ok(vec!["a"]));
        assert_eq!(order.hand_over(18, "b"), Ok(vec!["b"]));
        assert_eq!(order.hand_over(19, "c"), Ok(vec!["c"]));
    }

    #[test]
    fn a_step_handed_over_before_the_one_it_follows_is_written_right_after_it() {
        let mut order = Order::default();
        assert_eq!(order.hand_over(4, "4"), Ok(vec!["4"]));
        assert_eq!(order.hand_over(6, "6"), Ok(vec![]));
        assert_eq!(order.hand_over(7, "7"), Ok(vec![]));
        assert_eq!(order.hand_over(5, "5"), Ok(vec!["5", "6", "7"]));
        assert_eq!(order.hand_over(8, "8"), Ok(vec!["8"]));
    }

    #[test]
    fn a_step_not_after_the_last_written_comes_back() {
        let mut order = Order::default();
        assert_eq!(order.hand_over(4, "4"), Ok(vec!["4"]));
        assert_eq!(order.hand_over(4, "again"), Err((4, "again")));
        assert_eq!(order.hand_over(2, "old"), Err((4, "old")));
        assert_eq!(order.hand_over(5, "5"), Ok(vec!["5"]));
    }

    #[test]
    fn a_forgotten_held_step_is_never_written() {
        let mut order = Order::default();
        assert_eq!(order.hand_over(4, "4"), Ok(vec!["4"]));
        assert_eq!(order.hand_over(6, "6"), Ok(vec![]));
        assert!(order.forget(6));
        assert!(!order.forget(4)); // written, not held
        assert_eq!(order.hand_over(5, "5"), Ok(vec!["5"]));
        assert!(order.held.is_empty());
    }
}
