//! The batching loop: the one task that owns the scheduler and every request's decoding
//! state. It takes new requests, drops those whose client left, schedules, sends each
//! step to the shards and applies their answer (`output`); a step that fails fails every
//! request in flight. It records when it waits for a step (`progress`, for `/ready`), and
//! when a drain is cut it fails every request it still holds and stops. LoRA adapters
//! (`adapters`): before each schedule it learns which adapters the waiting requests wait
//! for have loaded, and it tells the registry what its steps page in and out.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::handle::Admission;
use super::output::Entry;
use super::progress::StepClock;
use super::siblings::Sibling;
use super::speculation::{Speculation, SpeculativeConfig};
use crate::blocks::RequestId;
use crate::client::Backend;
use crate::constraints::MaskShape;
use crate::detokenize::TokenizerInfo;
use crate::drain::Drain;
use crate::error::{InferError, ShardError};
use crate::lora::{Registry, Residency};
use crate::metrics::{LoadGauges, Metrics};
use crate::pb;
use crate::scheduler::{Schedule, Scheduler, SchedulerConfig};

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
pub(super) struct InFlight {
    step_id: u64,
    num_tokens: usize,
    /// Requests the shards sample a token for.
    samples: Vec<RequestId>,
    /// Requests whose proposals it verifies.
    speculating: usize,
    /// Adapters it pages out: the shards no longer hold them once it is answered.
    adapters_out: Vec<String>,
    sent: Instant,
    answer: JoinHandle<Result<pb::StepResponse, ShardError>>,
    /// The traced requests' prefill chunks in it (`spans`), ended by its answer.
    prefill_spans: Vec<opentelemetry_sdk::trace::Span>,
}

pub(super) struct Loop<B> {
    backend: Arc<B>,
    pub(super) tokenizer: TokenizerInfo,
    pub(super) eos: HashSet<u32>,
    pub(super) scheduler: Scheduler,
    pub(super) entries: HashMap<RequestId, Entry>,
    /// Siblings waiting to fork from their first sample, keyed by its id.
    pub(super) siblings: HashMap<RequestId, Vec<Sibling>>,
    pub(super) next_id: RequestId,
    pub(super) metrics: Arc<Metrics>,
    pub(super) load: Arc<LoadGauges>,
    progress: Arc<StepClock>,
    /// Nothing can run before then (a dynamic batch waiting to fill).
    wake_at: Option<Instant>,
    async_scheduling: bool,
    pub(super) mask_shape: MaskShape,
    pub(super) fast_forward: bool,
    /// Speculative decoding's proposers (None: off).
    pub(super) speculation: Option<Speculation>,
    /// The oldest step sent and not yet applied.
    pub(super) in_flight: Option<InFlight>,
    /// The adapters this replica's steps have paged in, as told to the registry.
    pub(super) residency: Residency,
    /// Wakes the loop when an adapter's load ends or an adapter is unloaded.
    pub(super) adapter_changes: tokio::sync::watch::Receiver<u64>,
    /// The registry's version last applied (`sync_adapters`).
    pub(super) adapters_seen: u64,
    /// Nothing can run until an adapter's load ends (or a request arrives).
    pub(super) awaiting_adapters: bool,
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
    let mut lp = Loop {
        backend: Arc::new(backend),
        tokenizer,
        eos: config.eos_token_ids.into_iter().collect(),
        scheduler: Scheduler::new(config.scheduler),
        entries: HashMap::new(),
        siblings: HashMap::new(),
        next_id: 0,
        metrics,
        load,
        progress,
        wake_at: None,
        async_scheduling: config.async_scheduling,
        mask_shape: config.mask_shape,
        fast_forward: config.grammar_fast_forward,
        speculation: config.speculative.map(Speculation::new),
        in_flight: None,
        adapter_changes: config.adapters.subscribe(),
        residency: Residency::new(config.adapters),
        adapters_seen: 0,
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
                    _ = self.adapter_changes.changed() => {}
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
        let held = self.entries.len();
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
        self.residency.release_all();
        let siblings = self.siblings.drain().flat_map(|(_, s)| s).map(|s| s.entry);
        for mut entry in self.entries.drain().map(|(_, e)| e).chain(siblings) {
            self.metrics.requests_failed.add(1);
            entry.spans.fail(&error);
            let _ = entry.events.send(Err(error.clone()));
        }
    }

    /// Drops the requests whose client went away, and records the gauges at once: when
    /// they were the last work the loop sleeps next, and no step would record them.
    fn drop_cancelled(&mut self) {
        let gone: Vec<RequestId> = self
            .entries
            .iter()
            .filter(|(_, e)| e.events.is_closed())
            .map(|(&id, _)| id)
            .collect();
        if gone.is_empty() {
            return;
        }
        for id in gone {
            if let Some(entry) = self.retire(id) {
                let request_id = &*entry.request_id;
                tracing::debug!(request_id, id, "client went away; cancelled");
            }
        }
        self.record_state();
    }

    /// Drops a request everywhere: blocks now, shard state at the next step.
    pub(super) fn retire(&mut self, id: RequestId) -> Option<Entry> {
        self.scheduler.finish(id);
        if let Some(speculation) = self.speculation.as_mut() {
            speculation.forget(id);
        }
        self.start_siblings(id, false);
        self.entries.remove(&id)
    }

    pub(super) fn fail(&mut self, id: RequestId, error: InferError) {
        if let Some(mut entry) = self.retire(id) {
            self.metrics.requests_failed.add(1);
            tracing::warn!(request_id = &*entry.request_id, id, %error, "failed");
            entry.spans.fail(&error);
            let _ = entry.events.send(Err(error));
        }
    }

    /// Sends a step unless one is in flight, sends the next one ahead of it when
    /// asynchronous scheduling allows, then applies the answer of the one in flight.
    async fn iterate(&mut self) {
        if self.in_flight.is_none() {
            if let Some(speculation) = self.speculation.as_mut() {
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
                .speculation
                .as_ref()
                .is_some_and(|s| s.may_speculate(&self.scheduler));
        let mut next = None;
        if self.async_scheduling
            && self.siblings.is_empty()
            && !self.any_constrained()
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
        self.record_schedule(&schedule);
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
                free_blocks = self.scheduler.blocks().num_free(),
                "KV cache full: preempted"
            );
        }
        let Some(mut step) = schedule.step else {
            self.wake_at = schedule.wake_at;
            return None;
        };
        step.allowed = self.masks(&schedule.samples);
        let sent = Instant::now();
        for joined in &step.joined {
            if let Some(entry) = self.entries.get_mut(&joined.id) {
                entry.started_at.get_or_insert(sent);
            }
        }
        let prefill_spans = self.prefill_spans(&step);
        self.scheduler.expect_samples(&schedule.samples);
        self.residency
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
            answer: tokio::spawn(answer),
            prefill_spans,
        })
    }

    /// Whether a request with a grammar is queued or running.
    fn any_constrained(&self) -> bool {
        self.entries.values().any(|e| e.grammar.is_some())
    }

    /// The allowed-token masks of the constrained requests among `samples`. A request
    /// whose grammar fails here gets an EOS-only mask and fails (its token is dropped).
    fn masks(&mut self, samples: &[RequestId]) -> Vec<pb::AllowedTokens> {
        let started = Instant::now();
        let mut masks = Vec::new();
        let mut failed = Vec::new();
        for &id in samples {
            let Some(grammar) = self.entries.get_mut(&id).and_then(|e| e.grammar.as_mut()) else {
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
            if let Some(speculation) = self.speculation.as_mut() {
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
        let answer = match answer.await {
            Ok(answer) => answer,
            Err(e) => Err(ShardError {
                rank: 0,
                message: format!("the step task ended: {e}"),
            }),
        };
        // Answered or failed, the shards no longer hold what it paged out.
        self.residency.paged_out(&adapters_out);
        drop(prefill_spans); // the chunks are computed (or failed): their spans end

        match answer {
            Ok(response) => {
                let router_start = Instant::now();
                let m = &self.metrics;
                m.step_time
                    .observe(router_start.duration_since(sent).as_secs_f64());
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
                self.fail_all(InferError::Generation(format!("generation failed: {e}")));
                self.backend.end_session();
                false
            }
        }
    }
}
