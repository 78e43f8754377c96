//! The batching loop and its handle.
//!
//! One task owns every piece of batch state (the scheduler, each request's decoding
//! state); HTTP handlers talk to it over channels. Each iteration: take new requests,
//! drop those whose client left, schedule, send the Step diff to the shards, then turn
//! the sampled tokens into text, check EOS / stop strings / length, stream, and retire
//! finished requests (their blocks are freed at once, their shard state at the next step).
//!
//! Asynchronous scheduling (unless `--no-async-scheduling`; `cadence launch` keeps it for
//! GPUs, see docs/scheduler.md): while step N runs, the loop schedules step
//! N + 1 ahead (`Scheduler::schedule_ahead`, N's samples pending) and sends it, then waits
//! for N's tokens. The shards run steps in the order sent, so they go from N to N + 1
//! without waiting for the router, and the router's work and the round trip overlap the
//! forward. A request that ends at step N (EOS, a stop string) has one more token computed
//! by N + 1, which is dropped.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinHandle;

use crate::blocks::RequestId;
use crate::client::Backend;
use crate::detokenize::{Detokenizer, TokenizerInfo};
use crate::error::InferError;
use crate::error::ShardError;
use crate::metrics::Metrics;
use crate::pb;
use crate::scheduler::{Scheduler, SchedulerConfig, Sequence};
use crate::stop::StopMatcher;
use crate::validation::{GenerateRequest, ValidRequest, Validation};

#[derive(Debug, Clone, Serialize, PartialEq, utoipa::ToSchema)]
pub struct Token {
    pub id: u32,
    pub text: String,
    pub logprob: Option<f32>,
    pub special: bool,
}

#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    Length,
    EosToken,
    StopSequence,
}

/// How a request ended; carried by its last event.
#[derive(Debug, Clone)]
pub struct End {
    pub finish_reason: FinishReason,
    /// The generated text (stop string excluded), prefixed by the prompt when asked.
    pub generated_text: String,
    pub generated_tokens: usize,
    pub input_length: usize,
    pub seed: Option<u64>,
    /// Sum of the sampled tokens' logprobs (what best_of ranks by).
    pub cumulative_logprob: f32,
    /// From arrival to the first step that computed it.
    pub queue_time: Duration,
    /// From that step to the last token.
    pub inference_time: Duration,
}

/// One generated token, as sent to the request's handler.
#[derive(Debug, Clone)]
pub struct TokenEvent {
    pub token: Token,
    pub top_tokens: Vec<Token>,
    /// With the first event when prompt logprobs were asked: every prompt token (the
    /// first has no logprob) and, with top_n_tokens, the alternatives to each but the
    /// first.
    pub prefill: Vec<Token>,
    pub prefill_top_tokens: Vec<Vec<Token>>,
    pub end: Option<End>,
}

pub type EventResult = Result<TokenEvent, InferError>;

/// A validated request on its way to the loop.
struct Admission {
    request: ValidRequest,
    /// One channel per sample (`best_of` of them), in sample order.
    samples: Vec<mpsc::UnboundedSender<EventResult>>,
    permit: OwnedSemaphorePermit,
    queued_at: Instant,
    /// One place in the bounded waiting queue for all the samples of the request.
    slot: QueueSlot,
}

/// A queued request: what validation made of it, one event stream per sample.
pub struct Submitted {
    pub request: ValidRequest,
    pub samples: Vec<mpsc::UnboundedReceiver<EventResult>>,
}

/// The seed of sample `index` of a request: the request's own for the first, then
/// distinct ones derived from it (SplitMix64), so a seeded request is reproducible.
pub fn sample_seed(seed: u64, index: usize) -> u64 {
    if index == 0 {
        return seed;
    }
    let mut z = seed.wrapping_add((index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A place in the bounded waiting queue, held from submission until the request's first
/// step (or its end, whichever comes first).
struct QueueSlot(Arc<AtomicUsize>);

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
/// metrics.
#[derive(Clone)]
pub struct Infer {
    pub validation: Arc<Validation>,
    limiter: Arc<Semaphore>,
    queued: Arc<AtomicUsize>,
    max_waiting_requests: usize,
    metrics: Arc<Metrics>,
    tx: mpsc::UnboundedSender<Admission>,
}

/// The loop's fixed inputs.
pub struct LoopConfig {
    pub scheduler: SchedulerConfig,
    pub eos_token_ids: Vec<u32>,
    /// Requests waiting for their first step beyond which new ones get 429.
    pub max_waiting_requests: usize,
    /// The `model` label of the metrics.
    pub model_id: String,
    /// Schedule step N + 1 while step N runs (see the module documentation).
    pub async_scheduling: bool,
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
        let metrics = Arc::new(Metrics::new(&config.model_id));
        let max_waiting_requests = config.max_waiting_requests;
        tokio::spawn(batching_loop(
            backend,
            rx,
            tokenizer,
            config,
            metrics.clone(),
        ));
        Self {
            validation: Arc::new(validation),
            limiter: Arc::new(Semaphore::new(max_concurrent_requests)),
            queued: Arc::new(AtomicUsize::new(0)),
            max_waiting_requests,
            metrics,
            tx,
        }
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Takes a slot among the concurrent requests, or answers 429.
    pub fn try_permit(&self) -> Result<OwnedSemaphorePermit, InferError> {
        self.limiter.clone().try_acquire_owned().map_err(|_| {
            InferError::Overloaded("too many requests in flight, try again later".into())
        })
    }

    /// Validates a request and queues it. Errors come before any token, so a handler can
    /// still answer with a status code.
    pub async fn submit(
        &self,
        request: GenerateRequest,
    ) -> Result<(ValidRequest, mpsc::UnboundedReceiver<EventResult>), InferError> {
        let permit = self
            .try_permit()
            .inspect_err(|_| self.metrics.requests_rejected.add(1))?;
        let valid = self.validation.validate(request).await?;
        let mut submitted = self.enqueue(valid, permit)?;
        Ok((submitted.request, submitted.samples.remove(0)))
    }

    /// Queues a validated request (taken a permit for) as its `best_of` samples.
    pub fn enqueue(
        &self,
        request: ValidRequest,
        permit: OwnedSemaphorePermit,
    ) -> Result<Submitted, InferError> {
        let Some(slot) = QueueSlot::try_take(&self.queued, self.max_waiting_requests) else {
            self.metrics.requests_rejected.add(1);
            return Err(InferError::Overloaded(format!(
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
        };
        self.tx
            .send(admission)
            .map_err(|_| InferError::Generation("the batching loop has stopped".into()))?;
        Ok(Submitted { request, samples })
    }
}

/// Per-request state the loop keeps beside the scheduler's `Sequence`.
struct Entry {
    events: mpsc::UnboundedSender<EventResult>,
    detokenizer: Detokenizer,
    stop: StopMatcher,
    max_new_tokens: usize,
    ignore_eos: bool,
    input_length: usize,
    generated: usize,
    text: String,
    prefix: Option<String>,
    seed: Option<u64>,
    prompt: Option<Vec<u32>>,
    cumulative_logprob: f32,
    queued_at: Instant,
    started_at: Option<Instant>,
    first_token_at: Option<Instant>,
    last_token_at: Option<Instant>,
    /// Released at the request's first step; shared by its samples.
    slot: Option<Arc<QueueSlot>>,
    /// Shared by the samples of one request: the slot frees when the last one ends.
    _permit: Arc<OwnedSemaphorePermit>,
}

/// A sample 1.. of a `best_of` request, held until sample 0 has computed the prompt.
struct Sibling {
    seq: Sequence,
    entry: Entry,
}

/// A step sent to the shards whose answer has not been applied yet.
struct InFlight {
    step_id: u64,
    num_tokens: usize,
    /// Requests the shards sample a token for.
    samples: Vec<RequestId>,
    sent: Instant,
    answer: JoinHandle<Result<pb::StepResponse, ShardError>>,
}

struct Loop<B> {
    backend: Arc<B>,
    tokenizer: TokenizerInfo,
    eos: HashSet<u32>,
    scheduler: Scheduler,
    entries: HashMap<RequestId, Entry>,
    /// Siblings waiting to fork from their first sample, keyed by its id.
    siblings: HashMap<RequestId, Vec<Sibling>>,
    next_id: RequestId,
    /// The shards may hold stale state (a step failed, or this is the first step) and
    /// are cleared before the next step.
    needs_clear: bool,
    metrics: Arc<Metrics>,
    /// Nothing can run before then (a dynamic batch waiting to fill).
    wake_at: Option<Instant>,
    async_scheduling: bool,
    /// The oldest step sent and not yet applied.
    in_flight: Option<InFlight>,
    /// The shards have run a step since they were last cleared, so they know which
    /// step id comes next and run a step sent ahead after the one before it. (Cleared
    /// at the first step, so a shard left with another router's ids starts over.)
    in_order: bool,
}

async fn batching_loop<B: Backend>(
    backend: B,
    mut rx: mpsc::UnboundedReceiver<Admission>,
    tokenizer: TokenizerInfo,
    config: LoopConfig,
    metrics: Arc<Metrics>,
) {
    metrics
        .kv_blocks_total
        .set(config.scheduler.num_blocks as f64);
    let mut lp = Loop {
        backend: Arc::new(backend),
        tokenizer,
        eos: config.eos_token_ids.into_iter().collect(),
        scheduler: Scheduler::new(config.scheduler),
        entries: HashMap::new(),
        siblings: HashMap::new(),
        next_id: 0,
        metrics,
        wake_at: None,
        async_scheduling: config.async_scheduling,
        in_flight: None,
        needs_clear: true,
        in_order: false,
    };
    loop {
        // 1. New requests; sleep on the channel only when there is nothing to run (or
        //    nothing before `wake_at`).
        if !lp.scheduler.has_work() && lp.in_flight.is_none() {
            match rx.recv().await {
                Some(admission) => lp.admit(admission),
                None => return,
            }
        } else if let Some(at) = lp.wake_at.take() {
            tokio::select! {
                admission = rx.recv() => match admission {
                    Some(admission) => lp.admit(admission),
                    None => return,
                },
                _ = tokio::time::sleep_until(at.into()) => {}
            }
        }
        while let Ok(admission) = rx.try_recv() {
            lp.admit(admission);
        }
        // 2. Clients that went away.
        lp.drop_cancelled();
        if !lp.scheduler.has_work() && lp.in_flight.is_none() {
            continue;
        }
        lp.iterate().await;
    }
}

impl<B: Backend> Loop<B> {
    /// Queues a request's samples. This is the one place siblings are created: each is
    /// its own sequence with a seed derived from the request's (the first keeps it).
    /// Only the first is queued; the others wait in `siblings` until it has computed the
    /// prompt, then fork from it (`start_siblings`) and share its blocks copy-on-write.
    fn admit(&mut self, admission: Admission) {
        let Admission {
            request,
            samples,
            permit,
            queued_at,
            slot,
        } = admission;
        let permit = Arc::new(permit);
        let slot = Arc::new(slot);
        let first = self.next_id;
        for (index, events) in samples.into_iter().enumerate() {
            // Siblings get their id when they start (a fork's id must be the newest).
            let id = if index == 0 { first } else { RequestId::MAX };
            if index == 0 {
                self.next_id += 1;
            }
            let seed = request.seed.map(|s| sample_seed(s, index));
            let mut sampling = request.sampling.clone();
            sampling.seed = seed.unwrap_or(0);
            let mut seq = Sequence::new(id, request.input_ids.clone(), sampling);
            seq.max_new_tokens = request.max_new_tokens;
            seq.top_n_tokens = request.top_n_tokens;
            seq.adapter_id = request.adapter_id.clone();
            // Siblings share the prompt: its logprobs come with the first only.
            seq.prompt_logprobs = request.prompt_logprobs && index == 0;
            let entry = Entry {
                events,
                detokenizer: Detokenizer::new(&seq.token_ids),
                stop: StopMatcher::new(request.stop.clone()),
                max_new_tokens: request.max_new_tokens,
                ignore_eos: request.ignore_eos,
                input_length: seq.prompt_len,
                generated: 0,
                text: String::new(),
                prefix: request.prefix.clone(),
                seed,
                prompt: seq.prompt_logprobs.then(|| request.input_ids.clone()),
                cumulative_logprob: 0.0,
                queued_at,
                started_at: None,
                first_token_at: None,
                last_token_at: None,
                slot: Some(slot.clone()),
                _permit: permit.clone(),
            };
            self.metrics.prompt_tokens.add(seq.prompt_len as u64);
            tracing::debug!(first, index, input_tokens = seq.prompt_len, "queued");
            if index == 0 {
                self.scheduler.add(seq);
                self.entries.insert(id, entry);
            } else {
                self.siblings
                    .entry(first)
                    .or_default()
                    .push(Sibling { seq, entry });
            }
        }
    }

    /// Starts the siblings waiting on `first`: forked from it when it has just computed
    /// the prompt (`fork`: its first token is being applied, not yet appended), else (it
    /// ended before that, or the batch is full) queued as independent requests, which
    /// still share the prompt's full blocks through the prefix cache.
    fn start_siblings(&mut self, first: RequestId, fork: bool) {
        let Some(siblings) = self.siblings.remove(&first) else {
            return;
        };
        let started_at = self.entries.get(&first).and_then(|e| e.started_at);
        for Sibling { mut seq, mut entry } in siblings {
            if entry.events.is_closed() {
                continue;
            }
            let id = self.next_id;
            self.next_id += 1;
            if fork && self.scheduler.fork(first, id, seq.sampling.seed) {
                tracing::debug!(id, first, "forked");
                entry.slot = None;
                entry.started_at = started_at;
            } else {
                seq.id = id;
                self.scheduler.add(seq);
            }
            self.entries.insert(id, entry);
        }
    }

    fn drop_cancelled(&mut self) {
        let gone: Vec<RequestId> = self
            .entries
            .iter()
            .filter(|(_, e)| e.events.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            tracing::debug!(id, "client went away; cancelled");
            self.retire(id);
        }
    }

    /// Drops a request everywhere: blocks now, shard state at the next step.
    fn retire(&mut self, id: RequestId) -> Option<Entry> {
        self.scheduler.finish(id);
        self.start_siblings(id, false);
        self.entries.remove(&id)
    }

    fn fail(&mut self, id: RequestId, error: InferError) {
        if let Some(entry) = self.retire(id) {
            self.metrics.requests_failed.add(1);
            let _ = entry.events.send(Err(error));
        }
    }

    /// 3-6: schedule (ahead of the step in flight, when one runs), send the step, apply
    /// what the oldest step in flight sampled.
    async fn iterate(&mut self) {
        if self.in_flight.is_none() {
            let schedule = self.scheduler.schedule();
            match self.send(schedule).await {
                Some(step) => self.in_flight = Some(step),
                None => {
                    // Only preemptions happened, or a dynamic batch is filling.
                    self.record_state();
                    tokio::task::yield_now().await;
                    return;
                }
            }
        }
        // Siblings fork from their first sample's state as of its first token: no step
        // may be scheduled past that before it is applied.
        let mut next = None;
        if self.async_scheduling && self.siblings.is_empty() && self.in_order {
            let schedule = self.scheduler.schedule_ahead();
            next = self.send(schedule).await;
            self.wake_at = None; // decided again once the step in flight is applied
        }
        let step = self.in_flight.take().expect("a step is in flight");
        let ok = self.apply_step(step).await;
        self.in_order = ok;
        match next {
            Some(next) if ok => self.in_flight = Some(next),
            Some(next) => next.answer.abort(), // sent over state the failure discarded
            None => {}
        }
        self.record_state();
    }

    /// Records a schedule and sends its step, if it has one, to the shards.
    async fn send(&mut self, schedule: crate::scheduler::Schedule) -> Option<InFlight> {
        self.record_schedule(&schedule);
        for id in schedule.failed {
            self.fail(
                id,
                InferError::Generation("the request does not fit in the KV cache".into()),
            );
        }
        if !schedule.preempted.is_empty() || !schedule.swapped_out.is_empty() {
            tracing::info!(
                recomputed = ?schedule.preempted,
                swapped = ?schedule.swapped_out,
                free_blocks = self.scheduler.blocks().num_free(),
                "KV cache full: preempted"
            );
        }
        let Some(step) = schedule.step else {
            self.wake_at = schedule.wake_at;
            return None;
        };
        if self.needs_clear {
            if let Err(e) = self.backend.clear_cache().await {
                tracing::warn!(error = %e, "clearing the shards failed");
            }
            self.needs_clear = false;
            self.in_order = false;
        }
        let sent = Instant::now();
        for joined in &step.joined {
            if let Some(entry) = self.entries.get_mut(&joined.id) {
                entry.started_at.get_or_insert(sent);
            }
        }
        self.scheduler.expect_samples(&schedule.samples);
        let step_id = step.step_id;
        let backend = self.backend.clone();
        Some(InFlight {
            step_id,
            num_tokens: schedule.num_tokens,
            samples: schedule.samples,
            sent,
            answer: tokio::spawn(async move { backend.step(step).await }),
        })
    }

    /// Waits for a step's answer and applies it; false when the step failed (every
    /// request in flight failed with it, and the shards are cleared before the next).
    async fn apply_step(&mut self, step: InFlight) -> bool {
        let InFlight {
            step_id,
            num_tokens,
            samples,
            sent,
            answer,
        } = step;
        let answer = match answer.await {
            Ok(answer) => answer,
            Err(e) => Err(ShardError {
                rank: 0,
                message: format!("the step task ended: {e}"),
            }),
        };
        match answer {
            Ok(response) => {
                let router_start = Instant::now();
                let expected: HashSet<RequestId> = samples.iter().copied().collect();
                let mut sampled = HashSet::with_capacity(response.generations.len());
                for generation in response.generations {
                    if !expected.contains(&generation.id) {
                        // A token for a request that had not caught up: its state would
                        // diverge from the shard's, so it cannot go on.
                        self.fail(
                            generation.id,
                            InferError::Generation("the shard sampled out of turn".into()),
                        );
                        continue;
                    }
                    sampled.insert(generation.id);
                    self.apply(generation);
                }
                for id in samples {
                    if !sampled.contains(&id) && self.entries.contains_key(&id) {
                        self.fail(
                            id,
                            InferError::Generation("the shard returned no token".into()),
                        );
                    }
                }
                tracing::trace!(
                    step_id,
                    tokens = num_tokens,
                    step_us = router_start.duration_since(sent).as_micros() as u64,
                    forward_us = response.forward_ns / 1000,
                    apply_us = router_start.elapsed().as_micros() as u64,
                    "step"
                );
                true
            }
            Err(e) => {
                tracing::error!(step_id, error = %e, "step failed; failing every request in flight");
                let message = format!("generation failed: {e}");
                for id in self.scheduler.reset() {
                    if let Some(entry) = self.entries.remove(&id) {
                        self.metrics.requests_failed.add(1);
                        let _ = entry
                            .events
                            .send(Err(InferError::Generation(message.clone())));
                    }
                }
                for Sibling { entry, .. } in self.siblings.drain().flat_map(|(_, s)| s) {
                    self.metrics.requests_failed.add(1);
                    let _ = entry
                        .events
                        .send(Err(InferError::Generation(message.clone())));
                }
                self.needs_clear = true;
                false
            }
        }
    }

    /// Step-level metrics, and the end of the queue wait for requests admitted now.
    fn record_schedule(&mut self, schedule: &crate::scheduler::Schedule) {
        let m = &self.metrics;
        m.preemptions_recompute.add(schedule.preempted.len() as u64);
        m.preemptions_swap.add(schedule.swapped_out.len() as u64);
        m.prefix_queries.add(schedule.prefix_queried as u64);
        m.prefix_hits.add(schedule.prefix_hits as u64);
        if let Some(step) = &schedule.step {
            let size = step.joined.len() + step.continuing.len();
            if size > 0 {
                m.batch_size.observe(size as f64);
                m.batch_tokens.observe(schedule.num_tokens as f64);
                m.step_tokens.add(schedule.num_tokens as u64);
            }
        }
        for id in &schedule.admitted {
            if let Some(entry) = self.entries.get_mut(id) {
                entry.slot = None;
                m.queue_time
                    .observe(entry.queued_at.elapsed().as_secs_f64());
            }
        }
    }

    /// Queue and KV gauges after a step.
    fn record_state(&self) {
        let m = &self.metrics;
        let s = &self.scheduler;
        m.waiting.set(s.num_waiting() as f64);
        m.running.set(s.num_running() as f64);
        let swapped = s.waiting().iter().filter(|q| !q.swapped.is_empty()).count();
        m.swapped.set(swapped as f64);
        m.kv_blocks_used.set(s.blocks().num_used() as f64);
        m.kv_blocks_cached.set(s.blocks().num_cached() as f64);
        m.kv_utilization.set(s.kv_utilization());
    }

    /// Applies one request's sampled tokens: text, stops, events, retirement.
    fn apply(&mut self, generation: pb::Generation) {
        let id = generation.id;
        // Its first token: the prompt is computed, so its siblings fork from it now.
        self.start_siblings(id, true);
        let Some(entry) = self.entries.get_mut(&id) else {
            return; // cancelled while the step ran
        };
        let mut accepted = Vec::with_capacity(generation.token_ids.len());
        let mut finished = false;
        let tokenizer = &self.tokenizer;
        let to_tokens = |top: &pb::TopTokens| -> Vec<Token> {
            top.ids
                .iter()
                .zip(&top.logprobs)
                .map(|(&id, &logprob)| Token {
                    id,
                    text: tokenizer.token_text(id),
                    logprob: Some(logprob),
                    special: tokenizer.is_special(id),
                })
                .collect()
        };
        let mut prefill = Vec::new();
        let mut prefill_top_tokens = Vec::new();
        if let Some(prompt) = entry.prompt.take() {
            prefill = prompt
                .iter()
                .enumerate()
                .map(|(i, &id)| Token {
                    id,
                    text: tokenizer.token_text(id),
                    logprob: i
                        .checked_sub(1)
                        .and_then(|j| generation.prompt_logprobs.get(j).copied()),
                    special: tokenizer.is_special(id),
                })
                .collect();
            prefill_top_tokens = generation.prompt_top_tokens.iter().map(to_tokens).collect();
        }
        for (i, &token_id) in generation.token_ids.iter().enumerate() {
            let top_tokens = generation
                .top_tokens
                .get(i)
                .map(to_tokens)
                .unwrap_or_default();
            let now = Instant::now();
            match entry.last_token_at {
                Some(last) => self.metrics.itl.observe((now - last).as_secs_f64()),
                None => self
                    .metrics
                    .ttft
                    .observe((now - entry.queued_at).as_secs_f64()),
            }
            entry.last_token_at = Some(now);
            self.metrics.generation_tokens.add(1);
            let mut event = entry.on_token(
                tokenizer,
                &self.eos,
                token_id,
                generation.logprobs.get(i).copied(),
                top_tokens,
            );
            event.prefill = std::mem::take(&mut prefill);
            event.prefill_top_tokens = std::mem::take(&mut prefill_top_tokens);
            accepted.push(token_id);
            finished = event.end.is_some();
            if let Some(end) = &event.end {
                let elapsed = entry.queued_at.elapsed();
                self.metrics.e2e.observe(elapsed.as_secs_f64());
                self.metrics.requests_succeeded.add(1);
                let ttft = entry
                    .first_token_at
                    .map(|t| t.duration_since(entry.queued_at));
                tracing::info!(
                    id,
                    generated_tokens = end.generated_tokens,
                    finish_reason = ?end.finish_reason,
                    total_ms = elapsed.as_millis() as u64,
                    ttft_ms = ttft.map(|t| t.as_millis() as u64),
                    "finished"
                );
            }
            let _ = entry.events.send(Ok(event));
            if finished {
                break;
            }
        }
        if finished {
            self.retire(id);
        } else {
            self.scheduler.append_tokens(id, &accepted);
        }
    }
}

impl Entry {
    fn on_token(
        &mut self,
        tokenizer: &TokenizerInfo,
        eos: &HashSet<u32>,
        id: u32,
        logprob: Option<f32>,
        top_tokens: Vec<Token>,
    ) -> TokenEvent {
        self.generated += 1;
        let now = Instant::now();
        if self.first_token_at.is_none() {
            self.first_token_at = Some(now);
        }
        self.cumulative_logprob += logprob.unwrap_or(0.0);
        let mut text = String::new();
        let mut finish = None;
        if eos.contains(&id) && !self.ignore_eos {
            finish = Some(FinishReason::EosToken);
        } else {
            let piece = self.detokenizer.push(tokenizer, id);
            let release = self.stop.push(&piece);
            text = release.text;
            if release.stopped {
                finish = Some(FinishReason::StopSequence);
            }
        }
        if finish.is_none() && self.generated >= self.max_new_tokens {
            finish = Some(FinishReason::Length);
        }
        if matches!(finish, Some(FinishReason::Length | FinishReason::EosToken)) {
            // Release what was held back (an incomplete character, a partial stop).
            let rest = self.detokenizer.flush(tokenizer);
            let release = self.stop.push(&rest);
            text.push_str(&release.text);
            if release.stopped {
                finish = Some(FinishReason::StopSequence);
            } else {
                text.push_str(&self.stop.flush());
            }
        }
        self.text.push_str(&text);
        let end = finish.map(|finish_reason| End {
            finish_reason,
            generated_text: match &self.prefix {
                Some(prefix) => format!("{prefix}{}", self.text),
                None => self.text.clone(),
            },
            generated_tokens: self.generated,
            input_length: self.input_length,
            seed: self.seed,
            cumulative_logprob: self.cumulative_logprob,
            queue_time: self
                .started_at
                .unwrap_or(now)
                .saturating_duration_since(self.queued_at),
            inference_time: now.saturating_duration_since(self.started_at.unwrap_or(now)),
        });
        TokenEvent {
            token: Token {
                id,
                text,
                logprob,
                special: tokenizer.is_special(id),
            },
            top_tokens,
            prefill: Vec::new(),
            prefill_top_tokens: Vec::new(),
            end,
        }
    }
}
