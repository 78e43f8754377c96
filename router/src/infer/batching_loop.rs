//! The batching loop: the one task that owns the scheduler and the request book (`book`:
//! every request's decoding state). It takes new requests, drops those whose client
//! left, schedules, sends each step to the shards and applies their answer (the book
//! sends the tokens, the scheduler appends them); a step that fails fails every request
//! in flight. It records when it waits for a step (`progress`, for `/ready`), and
//! when a drain is cut it fails every request it still holds and stops. LoRA adapters
//! (`adapters`): before each schedule it learns which adapters the waiting requests wait
//! for have loaded, and it tells the registry what its steps page in and out.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::adapters::Adapters;
use super::admission::Admission;
use super::book::{Outcome, RequestBook};
use super::progress::StepClock;
use super::speculation::{Speculation, SpeculativeConfig};
use super::step_metrics::{record_schedule, record_state};
use crate::blocks::RequestId;
use crate::client::Backend;
use crate::constraints::MaskShape;
use crate::detokenize::TokenizerInfo;
use crate::drain::Drain;
use crate::error::{InferError, ShardError};
use crate::lora::Registry;
use crate::metrics::{LoadGauges, Metrics};
use crate::pb;
use crate::scheduler::{Schedule, Scheduler, SchedulerConfig, Sequence};

/// The loop's fixed inputs.
#[derive(Clone)]
pub struct LoopConfig {
    pub scheduler: SchedulerConfig,
    pub eos_token_ids: Vec<u32>,
    /// Requests waiting for their first step beyond which new ones get 429.
    pub max_waiting_requests: usize,
    /// The name clients know the model by: the metrics' `model` and `model_name` labels.
    pub served_model_name: String,
    /// Schedule step N + 1 while step N runs (see the module documentation of `infer`).
    pub async_scheduling: bool,
    /// The logits' width and EOS ids, for constrained requests' masks.
    pub mask_shape: MaskShape,
    /// Append the tokens a grammar forces without sampling them.
    pub grammar_fast_forward: bool,
    /// Speculative decoding (None: off).
    pub speculative: Option<SpeculativeConfig>,
    /// The LoRA adapter registry, shared by every replica and the HTTP side.
    pub adapters: Arc<Registry>,
}

/// What the loop shares with the HTTP side.
pub(super) struct Shared {
    pub metrics: Arc<Metrics>,
    /// This loop's replica's queue and KV gauges.
    pub load: Arc<LoadGauges>,
    pub progress: Arc<StepClock>,
    pub drain: Arc<Drain>,
}

/// A step sent to the shards whose answer has not been applied yet.
struct InFlight {
    step_id: u64,
    num_tokens: usize,
    /// Requests the shards sample a token for.
    samples: Vec<RequestId>,
    /// Requests whose proposals it verifies.
    speculating: usize,
    /// Adapters it pages out: the shards no longer hold them once it is answered.
    adapters_out: Vec<String>,
    sent: Instant,
    /// The shards' answer, with when it came (the loop may be busy sending the next).
    answer: JoinHandle<(Result<pb::StepResponse, ShardError>, Instant)>,
    /// The traced requests' prefill chunks in it (`spans`), ended by its answer.
    prefill_spans: Vec<opentelemetry_sdk::trace::Span>,
}

struct Loop<B> {
    backend: Arc<B>,
    scheduler: Scheduler,
    /// Every request's decoding state, its samples and ids.
    book: RequestBook,
    metrics: Arc<Metrics>,
    load: Arc<LoadGauges>,
    progress: Arc<StepClock>,
    /// Nothing can run before then (a dynamic batch waiting to fill).
    wake_at: Option<Instant>,
    async_scheduling: bool,
    mask_shape: MaskShape,
    fast_forward: bool,
    /// The oldest step sent and not yet applied.
    in_flight: Option<InFlight>,
    /// When the last step's answer came: a step sent ahead starts on the shards then.
    last_answered: Option<Instant>,
    /// The LoRA adapters paged in, and the registry's changes.
    adapters: Adapters,
    /// Nothing can run until an adapter's load ends (or a request arrives).
    awaiting_adapters: bool,
}

/// Runs the loop until every handle (`Infer`) is dropped, or until a drain is cut.
pub(super) async fn run<B: Backend>(
    backend: B,
    mut rx: mpsc::UnboundedReceiver<Admission>,
    tokenizer: TokenizerInfo,
    config: LoopConfig,
    shared: Shared,
) {
    let Shared {
        metrics,
        load,
        progress,
        drain,
    } = shared;
    load.kv_blocks_total.set(config.scheduler.num_blocks as f64);
    if let Some(speculative) = &config.speculative {
        metrics.enable_speculative(speculative.max_tokens);
    }
    load.kv_block_size.set(config.scheduler.block_size as f64);
    let eos: HashSet<u32> = config.eos_token_ids.into_iter().collect();
    let speculation = config.speculative.map(Speculation::new);
    let mut lp = Loop {
        backend: Arc::new(backend),
        scheduler: Scheduler::new(config.scheduler),
        book: RequestBook::new(tokenizer, eos, metrics.clone(), speculation),
        metrics,
        load,
        progress,
        wake_at: None,
        async_scheduling: config.async_scheduling,
        mask_shape: config.mask_shape,
        fast_forward: config.grammar_fast_forward,
        in_flight: None,
        last_answered: None,
        adapters: Adapters::new(config.adapters),
        awaiting_adapters: false,
    };
    // The loop's future holds `lp` and `rx`: dropped here when the cut wins, so the
    // requests left can be failed (a step it was waiting for is abandoned).
    let cut = tokio::select! {
        () = lp.serve(&mut rx) => false,
        () = drain.cut_requested() => true,
    };
    if cut {
        lp.cut(&mut rx);
    }
}

impl<B: Backend> Loop<B> {
    /// Takes requests and runs steps until every handle is dropped.
    async fn serve(&mut self, rx: &mut mpsc::UnboundedReceiver<Admission>) {
        loop {
            // New requests; sleep on the channel (and the adapters' changes) only when
            // there is nothing to run (or nothing before `wake_at`).
            let idle = !self.scheduler.has_work() && self.in_flight.is_none();
            if idle || std::mem::take(&mut self.awaiting_adapters) {
                tokio::select! {
                    admission = rx.recv() => match admission {
                        Some(admission) => self.admit(admission),
                        None => return,
                    },
                    () = self.adapters.changed() => {}
                }
                self.sync_adapters();
            } else if let Some(at) = self.wake_at.take() {
                tokio::select! {
                    admission = rx.recv() => match admission {
                        Some(admission) => self.admit(admission),
                        None => return,
                    },
                    _ = tokio::time::sleep_until(at.into()) => {}
                }
            }
            while let Ok(admission) = rx.try_recv() {
                self.admit(admission);
            }
            self.drop_cancelled();
            if !self.scheduler.has_work() && self.in_flight.is_none() {
                continue;
            }
            self.iterate().await;
        }
    }

    /// The drain's timeout is up: fails every request held or still on its way in.
    fn cut(&mut self, rx: &mut mpsc::UnboundedReceiver<Admission>) {
        let message = "the server shut down before the request finished (--shutdown-timeout)";
        let held = self.book.len();
        self.fail_all(InferError::ShuttingDown(message.into()));
        rx.close();
        while let Ok(admission) = rx.try_recv() {
            for events in admission.samples {
                let _ = events.send(Err(InferError::ShuttingDown(message.into())));
            }
        }
        self.progress.idle();
        tracing::warn!(
            requests = held,
            "shutdown timeout: cut the requests in flight"
        );
    }

    /// Fails every request the loop holds (running, waiting, or waiting to fork) with
    /// `error`, and forgets them and their blocks.
    fn fail_all(&mut self, error: InferError) {
        self.scheduler.reset();
        self.adapters.residency().release_all();
        self.book.fail_all(&error);
    }

    /// Takes a request: the book queues its samples.
    fn admit(&mut self, admission: Admission) {
        self.book.admit(admission, &mut self.scheduler);
    }

    /// Drops the requests whose client went away, and records the gauges at once: when
    /// they were the last work the loop sleeps next, and no step would record them.
    fn drop_cancelled(&mut self) {
        if self.book.drop_cancelled(&mut self.scheduler) {
            self.record_state();
        }
    }

    /// Drops a request everywhere: blocks now, shard state at the next step.
    fn retire(&mut self, id: RequestId) {
        self.book.retire(id, &mut self.scheduler);
    }

    fn fail(&mut self, id: RequestId, error: InferError) {
        self.book.fail(id, error, &mut self.scheduler);
    }

    /// Brings the scheduler up to date with the adapters' loads; fails the requests
    /// waiting for one that could not be loaded.
    fn sync_adapters(&mut self) {
        for (id, error) in self.adapters.sync(&mut self.scheduler) {
            self.fail(id, error);
        }
    }

    /// Queue and KV gauges after a step.
    fn record_state(&self) {
        record_state(&self.load, &self.scheduler, self.adapters.enabled());
        let saved = self.book.beam_blocks_saved(&self.scheduler);
        self.load.kv_blocks_shared_by_beams.set(saved as f64);
    }

    /// Sends a step unless one is in flight, sends the next one ahead of it when
    /// asynchronous scheduling allows, then applies the answer of the one in flight.
    async fn iterate(&mut self) {
        if self.in_flight.is_none() {
            if let Some(speculation) = self.book.speculation() {
                speculation.propose(&mut self.scheduler);
            }
            self.sync_adapters();
            let schedule = self.scheduler.schedule();
            match self.send(schedule).await {
                Some(step) => {
                    self.in_flight = Some(step);
                    self.progress.waiting();
                }
                None => {
                    // Only preemptions happened, a dynamic batch is filling, or the
                    // waiting requests wait for their adapters' loads.
                    self.awaiting_adapters = self.scheduler.num_running() == 0
                        && !self.scheduler.adapters_awaited().is_empty();
                    self.record_state();
                    tokio::task::yield_now().await;
                    return;
                }
            }
        }
        // Siblings fork from their first sample's state as of its first token: no step
        // may be scheduled past that before it is applied. A constrained request's mask
        // needs its previous token, so none is scheduled ahead while one is in the loop.
        // Proposals follow the tokens the step in flight brings: while a step verifies some,
        // or the next could carry some, nothing is scheduled ahead.
        let speculating = self.in_flight.as_ref().is_some_and(|s| s.speculating > 0)
            || self
                .book
                .speculation_ref()
                .is_some_and(|s| s.may_speculate(&self.scheduler));
        let mut next = None;
        if self.async_scheduling
            && !self.book.has_siblings_waiting()
            && !self.book.any_constrained()
            && !self.book.has_beams()
            && !speculating
        {
            self.sync_adapters();
            let schedule = self.scheduler.schedule_ahead();
            next = self.send(schedule).await;
            self.wake_at = None; // decided again once the step in flight is applied
        }
        let step = self.in_flight.take().expect("a step is in flight");
        let ok = self.apply_step(step).await;
        match next {
            Some(next) if ok => self.in_flight = Some(next),
            Some(next) => next.answer.abort(), // sent over state the failure discarded
            None => {}
        }
        // An answer came: the wait for the next one, if it is already sent, starts now.
        if self.in_flight.is_some() {
            self.progress.waiting();
        } else {
            self.progress.idle();
        }
        self.record_state();
    }

    /// Records a schedule and sends its step, if it has one, to the shards.
    async fn send(&mut self, schedule: Schedule) -> Option<InFlight> {
        record_schedule(&self.metrics, &schedule, &mut self.book);
        for id in schedule.failed {
            self.fail(
                id,
                InferError::Generation("the request does not fit in the KV cache".into()),
            );
        }
        for (id, why) in schedule.refused {
            self.fail(
                id,
                InferError::Validation(format!("parameters.adapter_id: {why}")),
            );
        }
        if !schedule.preempted.is_empty() || !schedule.swapped_out.is_empty() {
            tracing::info!(
                recomputed = ?schedule.preempted,
                swapped = ?schedule.swapped_out,
                for_waiting = schedule.displaced,
                free_blocks = self.scheduler.blocks().num_free(),
                "{}",
                if schedule.displaced > 0 {
                    "preempted for a waiting request (--scheduling-policy)"
                } else {
                    "KV cache full: preempted"
                }
            );
        }
        let Some(mut step) = schedule.step else {
            self.wake_at = schedule.wake_at;
            return None;
        };
        step.allowed = self.masks(&schedule.samples);
        let sent = Instant::now();
        self.book.started(&step.joined, sent);
        let prefill_spans = self.book.prefill_spans(&step);
        self.scheduler.expect_samples(&schedule.samples);
        self.adapters
            .residency()
            .paged_in(step.adapters_in.iter().map(|a| a.name.as_str()));
        let adapters_out = step.adapters_out.clone();
        let step_id = step.step_id;
        // Handed to the shards now, in step_id order (the spawned task only waits).
        let answer = self.backend.step(step);
        Some(InFlight {
            step_id,
            num_tokens: schedule.num_tokens,
            samples: schedule.samples,
            speculating: schedule.speculating,
            adapters_out,
            sent,
            answer: tokio::spawn(async move { (answer.await, Instant::now()) }),
            prefill_spans,
        })
    }

    /// The allowed-token masks of the constrained requests among `samples`. A request
    /// whose grammar fails here gets an EOS-only mask and fails (its token is dropped).
    fn masks(&mut self, samples: &[RequestId]) -> Vec<pb::AllowedTokens> {
        let started = Instant::now();
        let mut masks = Vec::new();
        let mut failed = Vec::new();
        for &id in samples {
            let Some(grammar) = self.book.grammar(id) else {
                continue;
            };
            let words = grammar.allowed(&self.mask_shape).unwrap_or_else(|e| {
                failed.push((id, e));
                let mut words = self.mask_shape.none();
                self.mask_shape.allow_eos(&mut words);
                words
            });
            let words = words.iter().flat_map(|w| w.to_le_bytes()).collect();
            masks.push(pb::AllowedTokens { id, words });
        }
        if !masks.is_empty() {
            self.metrics
                .grammar_mask
                .observe(started.elapsed().as_secs_f64());
        }
        for (id, message) in failed {
            self.fail(id, InferError::Generation(message));
        }
        masks
    }

    /// Applies the verification of the proposals `generation`'s request carried, if any:
    /// the accepted ones count as computed, the rest's blocks go back. False (and the
    /// request failed) when the answer does not fit what was sent.
    fn verify(&mut self, generation: &pb::Generation) -> bool {
        let id = generation.id;
        let (proposed, accepted) = (
            generation.num_proposed as usize,
            generation.num_accepted as usize,
        );
        let sent = self.scheduler.get(id).map_or(0, |s| s.verifying);
        let fits =
            proposed == sent && accepted <= proposed && generation.token_ids.len() == accepted + 1;
        let applied = if fits {
            self.scheduler.verified(id, accepted)
        } else {
            Err(format!(
                "{} tokens answering {proposed} proposals ({accepted} accepted) where {sent} \
                 were sent",
                generation.token_ids.len()
            ))
        };
        if let Err(message) = applied {
            let message = format!("the shard's speculative answer is inconsistent: {message}");
            self.fail(id, InferError::Generation(message));
            return false;
        }
        if proposed > 0 {
            if let Some(m) = self.metrics.speculative() {
                m.record_verification(proposed, accepted);
            }
            if let Some(speculation) = self.book.speculation() {
                speculation.verified(id, proposed, accepted);
            }
        }
        true
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
            prefill_spans,
            adapters_out,
            ..
        } = step;
        let (answer, answered) = match answer.await {
            Ok(answered) => answered,
            Err(e) => {
                let failed = Err(ShardError {
                    rank: 0,
                    message: format!("the step task ended: {e}"),
                });
                (failed, Instant::now())
            }
        };
        // A step sent ahead waits on the shards behind the one before it: its own time
        // starts when that one is answered (the forward thread's queue), not when sent.
        let started = self.last_answered.map_or(sent, |last| last.max(sent));
        self.last_answered = Some(answered);
        // Answered or failed, the shards no longer hold what it paged out.
        self.adapters.residency().paged_out(&adapters_out);
        drop(prefill_spans); // the chunks are computed (or failed): their spans end

        match answer {
            Ok(response) => {
                let router_start = Instant::now();
                let m = &self.metrics;
                m.step_time
                    .observe(answered.saturating_duration_since(started).as_secs_f64());
                m.forward_time.observe(response.forward_ns as f64 * 1e-9);
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
                    if !self.verify(&generation) {
                        continue;
                    }
                    self.apply(generation);
                }
                self.book.yield_beam_blocks(&mut self.scheduler);
                for id in samples {
                    if !sampled.contains(&id) && self.book.contains(id) {
                        self.fail(
                            id,
                            InferError::Generation("the shard returned no token".into()),
                        );
                    }
                }
                tracing::trace!(
                    step_id,
                    tokens = num_tokens,
                    step_us = answered.saturating_duration_since(started).as_micros() as u64,
                    forward_us = response.forward_ns / 1000,
                    apply_us = router_start.elapsed().as_micros() as u64,
                    "step"
                );
                true
            }
            Err(e) => {
                tracing::error!(step_id, error = %e, "step failed; failing every request in flight");
                self.fail_all(InferError::Generation(format!("generation failed: {e}")));
                self.backend.end_session();
                false
            }
        }
    }

    /// Applies one request's sampled tokens: the book sends them (text, stops, events)
    /// and the scheduler appends them, or the request retires.
    fn apply(&mut self, generation: pb::Generation) {
        let id = generation.id;
        if self.book.is_beam(id) {
            self.book.beam_answer(&generation, &mut self.scheduler);
            return;
        }
        // Its first token: the prompt is computed, so its siblings fork from it now.
        self.book.start_siblings(id, true, &mut self.scheduler);
        let generated = self.scheduler.get(id).map_or(0, Sequence::num_generated);
        match self.book.emit_sampled(&generation, generated) {
            Outcome::Gone => {}
            Outcome::Ended => self.retire(id),
            Outcome::Failed(message) => self.fail(id, InferError::Generation(message)),
            Outcome::Continues => {
                self.scheduler.append_tokens(id, &generation.token_ids);
                if let Some(speculation) = self.book.speculation() {
                    speculation.extend(id, &generation.token_ids);
                }
                self.fast_forward(id);
            }
        }
    }

    /// Appends the tokens `id`'s grammar forces next, as generated tokens the next step
    /// computes (a short chunk) instead of sampling them one step each.
    fn fast_forward(&mut self, id: RequestId) {
        // Unconstrained requests stop at the first check (this runs for every token).
        // Forced tokens have no alternatives to report, and a pending token (a step
        // scheduled ahead) would come before them.
        if !self.fast_forward || !self.book.is_constrained(id) {
            return;
        }
        let Some(seq) = self.scheduler.get(id) else {
            return;
        };
        if seq.pending != 0 || seq.top_n_tokens != 0 {
            return;
        }
        let (forced, outcome) = self.book.emit_forced(id, seq.num_generated());
        match outcome {
            Outcome::Ended => self.retire(id),
            Outcome::Continues if !forced.is_empty() => {
                self.scheduler.append_forced(id, &forced);
            }
            _ => {}
        }
    }
}
