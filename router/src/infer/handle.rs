//! The HTTP side's handle on the batching loop, and the one way any route's request gets
//! in: `Infer::submit` refuses requests while draining, checks the admission limits,
//! validates, and queues the request's samples for the loop.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};

use super::batching_loop::{self, LoopConfig, Shared};
use super::events::EventResult;
use super::progress::StepClock;
use crate::client::Backend;
use crate::drain::Drain;
use crate::error::InferError;
use crate::metrics::Metrics;
use crate::request_scope::RequestContext;
use crate::validation::{Extra, GenerateParameters, Prompt, ValidRequest, Validation};

/// How often a drain checks whether the requests in flight have ended.
const IDLE_POLL: Duration = Duration::from_millis(10);

/// A validated request on its way to the loop.
pub(super) struct Admission {
    pub request: ValidRequest,
    /// One channel per sample (`best_of` of them), in sample order.
    pub samples: Vec<mpsc::UnboundedSender<EventResult>>,
    pub permit: OwnedSemaphorePermit,
    pub queued_at: Instant,
    /// One place in the bounded waiting queue for all the samples of the request.
    pub slot: QueueSlot,
    /// Its request id and trace.
    pub context: RequestContext,
}

/// A queued request: what validation made of it, one event stream per sample.
pub struct Submitted {
    pub request: ValidRequest,
    pub samples: Vec<mpsc::UnboundedReceiver<EventResult>>,
}

/// A place in the bounded waiting queue, held from submission until the request's first
/// step (or its end, whichever comes first).
pub(super) struct QueueSlot(Arc<AtomicUsize>);

impl QueueSlot {
    fn try_take(queued: &Arc<AtomicUsize>, max: usize) -> Option<Self> {
        queued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()
            .map(|_| Self(queued.clone()))
    }
}

impl Drop for QueueSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// What the HTTP side holds: validation, the admission limits, the way to the loop, the
/// metrics, the loop's progress and the drain.
#[derive(Clone)]
pub struct Infer {
    pub validation: Arc<Validation>,
    limiter: Arc<Semaphore>,
    max_concurrent_requests: usize,
    queued: Arc<AtomicUsize>,
    max_waiting_requests: usize,
    metrics: Arc<Metrics>,
    progress: Arc<StepClock>,
    drain: Arc<Drain>,
    tx: mpsc::UnboundedSender<Admission>,
}

impl Infer {
    /// Starts the batching loop on the current runtime.
    pub fn spawn<B: Backend>(
        backend: B,
        validation: Validation,
        max_concurrent_requests: usize,
        config: LoopConfig,
    ) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        let tokenizer = validation.tokenizer.clone();
        let metrics = Arc::new(Metrics::new(&config.served_model_name));
        let progress = Arc::new(StepClock::default());
        let drain = Arc::new(Drain::default());
        let max_waiting_requests = config.max_waiting_requests;
        let shared = Shared {
            metrics: metrics.clone(),
            progress: progress.clone(),
            drain: drain.clone(),
        };
        tokio::spawn(batching_loop::run(backend, rx, tokenizer, config, shared));
        Self {
            validation: Arc::new(validation),
            limiter: Arc::new(Semaphore::new(max_concurrent_requests)),
            max_concurrent_requests,
            queued: Arc::new(AtomicUsize::new(0)),
            max_waiting_requests,
            metrics,
            progress,
            drain,
            tx,
        }
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// When the loop started waiting for the step in flight (`/ready` reads it).
    pub fn progress(&self) -> &StepClock {
        &self.progress
    }

    pub fn drain(&self) -> &Drain {
        &self.drain
    }

    /// Requests admitted and not ended yet (queued, validating or generating).
    pub fn in_flight(&self) -> usize {
        self.max_concurrent_requests - self.limiter.available_permits()
    }

    /// Resolves once no request is in flight: every admitted request has ended (each
    /// holds a permit from admission to its end). Polled: `acquire_many` would hold the
    /// permits it gathers while it waits, and `in_flight` would read them as requests.
    pub async fn until_idle(&self) {
        while self.in_flight() > 0 {
            tokio::time::sleep(IDLE_POLL).await;
        }
    }

    /// Admits, validates and queues a request of any route as its `best_of` samples.
    /// Every error comes before any token, so a handler can still answer with a status
    /// code.
    pub async fn submit(
        &self,
        prompt: Prompt,
        parameters: GenerateParameters,
        extra: Extra,
    ) -> Result<Submitted, InferError> {
        // Before validation: a draining or overloaded router spends nothing on tokenizing.
        if self.drain.is_draining() {
            return Err(Drain::refusal());
        }
        let permit = self.try_permit()?;
        // Again, holding the permit: a drain that began since waits for it, or this
        // request sees the drain.
        if self.drain.is_draining() {
            return Err(Drain::refusal());
        }
        let request = self
            .validation
            .validate_prompt(prompt, parameters, extra)
            .await?;
        self.enqueue(request, permit)
    }

    /// Takes a slot among the concurrent requests, or answers 429.
    fn try_permit(&self) -> Result<OwnedSemaphorePermit, InferError> {
        self.limiter
            .clone()
            .try_acquire_owned()
            .map_err(|_| self.reject("too many requests in flight, try again later".into()))
    }

    /// Queues a validated request (taken a permit for) as its `best_of` samples, or
    /// answers 429 when the waiting queue is full.
    fn enqueue(
        &self,
        request: ValidRequest,
        permit: OwnedSemaphorePermit,
    ) -> Result<Submitted, InferError> {
        let Some(slot) = QueueSlot::try_take(&self.queued, self.max_waiting_requests) else {
            return Err(self.reject(format!(
                "the queue is full ({} requests waiting), try again later",
                self.max_waiting_requests
            )));
        };
        let (senders, samples): (Vec<_>, Vec<_>) = (0..request.best_of.max(1))
            .map(|_| mpsc::unbounded_channel())
            .unzip();
        let admission = Admission {
            request: request.clone(),
            samples: senders,
            permit,
            queued_at: Instant::now(),
            slot,
            context: RequestContext::current(),
        };
        self.tx
            .send(admission)
            .map_err(|_| InferError::Generation("the batching loop has stopped".into()))?;
        Ok(Submitted { request, samples })
    }

    /// A 429, counted: the one place `cadence_requests_rejected_total` grows.
    fn reject(&self, message: String) -> InferError {
        self.metrics.requests_rejected.add(1);
        InferError::Overloaded(message)
    }
}
