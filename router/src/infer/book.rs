//! The request book: the one owner of the requests a batching loop holds. It admits a
//! request as its samples (`best_of` of them: the first queued, the others waiting in
//! `siblings` to fork from it), hands out their ids, sends them their tokens (through
//! `emit`, the one way a token reaches a handler), and retires or fails them: a request
//! leaves the book, the scheduler (its blocks freed at once) and the proposers together.
//!
//! The loop keeps scheduling, sending steps and applying their answers; it tells the
//! book what an answer brought and the scheduler what the book decided.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use opentelemetry_sdk::trace::Span;

use super::admission::Admission;
use super::beam::{BeamGroups, Finished};
use super::beam_search::Search;
use super::emit::{NextToken, Output};
use super::entry::{Entry, SampleCommon};
use super::siblings::{sample_seed, Sibling};
use super::speculation::Speculation;
use crate::blocks::RequestId;
use crate::constraints::GrammarState;
use crate::detokenize::TokenizerInfo;
use crate::error::InferError;
use crate::metrics::Metrics;
use crate::pb;
use crate::scheduler::{Scheduler, Sequence};
use crate::telemetry;

/// How a request goes on after the tokens `emit_sampled` or `emit_forced` sent it.
pub(super) enum Outcome {
    /// It is no longer in the book (its client left while the step ran).
    Gone,
    /// It goes on: every token was sent and is to be appended.
    Continues,
    /// A token ended it (the last one sent); it is to be retired.
    Ended,
    /// Its grammar refused a token it was sent; it is to fail with this message.
    Failed(String),
}

pub(super) struct RequestBook {
    output: Output,
    entries: HashMap<RequestId, Entry>,
    /// Siblings waiting to fork from their first sample, keyed by its id.
    siblings: HashMap<RequestId, Vec<Sibling>>,
    /// The id the next sequence gets (ids only grow: a fork's id must be the newest).
    next_id: RequestId,
    /// Speculative decoding's proposers, one per eligible request (None: off).
    speculation: Option<Speculation>,
    /// The requests searched with beams (their samples are the group's, not `entries`).
    beams: BeamGroups,
}

impl RequestBook {
    pub(super) fn new(
        tokenizer: TokenizerInfo,
        eos: HashSet<u32>,
        metrics: Arc<Metrics>,
        speculation: Option<Speculation>,
    ) -> Self {
        Self {
            output: Output {
                tokenizer,
                eos,
                metrics,
            },
            entries: HashMap::new(),
            siblings: HashMap::new(),
            next_id: 0,
            speculation,
            beams: BeamGroups::default(),
        }
    }

    /// How many samples it holds (waiting to fork aside).
    pub(super) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether request `id` is held (not ended, failed or cancelled).
    pub(super) fn contains(&self, id: RequestId) -> bool {
        self.entries.contains_key(&id) || self.beams.owns(id)
    }

    /// Whether `id` is a beam of a beam search.
    pub(super) fn is_beam(&self, id: RequestId) -> bool {
        self.beams.owns(id)
    }

    /// Whether a beam search is under way (its rounds are ranked between steps, so no
    /// step is scheduled ahead).
    pub(super) fn has_beams(&self) -> bool {
        !self.beams.is_empty()
    }

    /// Whether some request's siblings still wait to fork from it.
    pub(super) fn has_siblings_waiting(&self) -> bool {
        !self.siblings.is_empty()
    }

    /// Speculative decoding's proposers, when on.
    pub(super) fn speculation(&mut self) -> Option<&mut Speculation> {
        self.speculation.as_mut()
    }

    pub(super) fn speculation_ref(&self) -> Option<&Speculation> {
        self.speculation.as_ref()
    }

    /// Whether a request with a grammar is queued or running.
    pub(super) fn any_constrained(&self) -> bool {
        self.entries.values().any(|e| e.grammar.is_some())
    }

    /// Whether request `id` has a grammar.
    pub(super) fn is_constrained(&self, id: RequestId) -> bool {
        self.entries.get(&id).is_some_and(|e| e.grammar.is_some())
    }

    /// Request `id`'s grammar, when it has one.
    pub(super) fn grammar(&mut self, id: RequestId) -> Option<&mut GrammarState> {
        self.entries.get_mut(&id)?.grammar.as_mut()
    }

    /// Queues a request's samples. This is the one place siblings are created: each is
    /// its own sequence with a seed derived from the request's (the first keeps it).
    /// Only the first is queued; the others wait in `siblings` until it has computed the
    /// prompt, then fork from it (`start_siblings`) and share its blocks copy-on-write.
    pub(super) fn admit(&mut self, admission: Admission, scheduler: &mut Scheduler) {
        let Admission {
            request,
            samples,
            permit,
            queued_at,
            slot,
            context,
        } = admission;
        let common = SampleCommon {
            queued_at,
            slot: Arc::new(slot),
            permit: Arc::new(permit),
            context,
        };
        let metrics = &self.output.metrics;
        if request.grammar.is_some() {
            metrics.constrained_requests.add(1);
            match request.grammar_compile_time {
                Some(took) => metrics.grammar_compile.observe(took.as_secs_f64()),
                None => metrics.grammar_cache_hits.add(1),
            }
        }
        metrics
            .requests
            .admitted(samples.len(), request.max_new_tokens);
        let first = self.next_id;
        let mut beam = request.beam.map(|params| (params, None, Vec::new()));
        tracing::info!(
            request_id = &*common.context.id,
            id = first,
            tenant = common.context.tenant.as_deref(),
            input_tokens = request.input_ids.len(),
            max_new_tokens = request.max_new_tokens,
            best_of = request.best_of,
            "admitted"
        );
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
            seq.request_id = common.context.id.clone();
            if let Some(tenant) = &common.context.tenant {
                seq.tenant = tenant.clone();
            }
            seq.weight = common.permit.tenant().map_or(1.0, |t| t.weight());
            seq.priority = request.priority;
            // Siblings share the prompt: its logprobs come with the first only.
            seq.prompt_logprobs = request.prompt_logprobs && index == 0;
            let entry = Entry::new(events, &request, &seq, seed, &common);
            if let Some((_, first_seq, entries)) = beam.as_mut() {
                // A beam search: one sequence (the prompt), every sample an entry.
                if index == 0 {
                    metrics.prompt_tokens.add(seq.prompt_len as u64);
                    if let Some(tenant) = common.permit.tenant() {
                        tenant.add_prompt_tokens(seq.prompt_len as u64);
                    }
                    *first_seq = Some(seq);
                }
                entries.push(entry);
                continue;
            }
            metrics.prompt_tokens.add(seq.prompt_len as u64);
            // Billed once per request, as the answers' usage reports it: siblings share
            // the prompt's blocks.
            if let (0, Some(tenant)) = (index, common.permit.tenant()) {
                tenant.add_prompt_tokens(seq.prompt_len as u64);
            }
            tracing::debug!(
                request_id = &*common.context.id,
                first,
                index,
                input_tokens = seq.prompt_len,
                "queued"
            );
            if index == 0 {
                // Proposals need one sample (siblings fork from shared blocks) and no
                // grammar (its mask exists only for the next position).
                let eligible = request.best_of == 1 && request.grammar.is_none();
                if let (Some(speculation), true) = (self.speculation.as_mut(), eligible) {
                    speculation.start(id, &seq.token_ids);
                }
                scheduler.add(seq);
                self.entries.insert(id, entry);
            } else {
                self.siblings
                    .entry(first)
                    .or_default()
                    .push(Sibling { seq, entry });
            }
        }
        if let Some((params, Some(seq), entries)) = beam {
            let keep = Search::candidates_per_round(params.width, self.output.eos.len());
            let eos = if request.ignore_eos {
                HashSet::new()
            } else {
                self.output.eos.clone()
            };
            self.beams.admit(seq, entries, params, keep, eos, scheduler);
        }
    }

    /// Beam `generation.id` answered: its round is ranked once every beam of its group
    /// has, and a finished search's hypotheses are sent to the request's samples.
    pub(super) fn beam_answer(&mut self, generation: &pb::Generation, scheduler: &mut Scheduler) {
        let Some(first) = self.beams.record(generation, scheduler) else {
            return;
        };
        let Some(Finished {
            hypotheses,
            mut entries,
        }) = self.beams.advance(first, scheduler, &mut self.next_id)
        else {
            return;
        };
        let output = &self.output;
        let mut hypotheses = hypotheses.into_iter();
        for entry in &mut entries {
            let Some(hypothesis) = hypotheses.next() else {
                let error = InferError::Generation("beam search ended short of hypotheses".into());
                entry.send_last(Err(error));
                continue;
            };
            entry.beam_score = Some(hypothesis.score);
            let nodes = hypothesis.history.nodes();
            for (i, node) in nodes.iter().enumerate() {
                let top = node
                    .top
                    .iter()
                    .map(|&(id, logprob)| output.token(id, logprob))
                    .collect();
                let token = NextToken {
                    id: node.token,
                    sampled: Some((Some(node.logprob), top)),
                };
                if output.emit(entry, first, token, i + 1, None) {
                    break;
                }
            }
        }
    }

    /// The beam groups waiting for a queued beam give their parked beams' blocks back.
    pub(super) fn yield_beam_blocks(&mut self, scheduler: &mut Scheduler) {
        self.beams.yield_blocks(scheduler);
    }

    /// Blocks the live beams save by sharing.
    pub(super) fn beam_blocks_saved(&self, scheduler: &Scheduler) -> usize {
        self.beams.blocks_saved(scheduler)
    }

    /// Starts the siblings waiting on `first`: forked from it when it has just computed
    /// the prompt (`fork`: its first token is being applied, not yet appended), else (it
    /// ended before that, or the batch is full) queued as independent requests, which
    /// still share the prompt's full blocks through the prefix cache.
    pub(super) fn start_siblings(
        &mut self,
        first: RequestId,
        fork: bool,
        scheduler: &mut Scheduler,
    ) {
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
            if fork && scheduler.fork(first, id, seq.sampling.seed) {
                tracing::debug!(request_id = &*entry.request_id, id, first, "forked");
                entry.spans.scheduled();
                entry.slot = None;
                entry.started_at = started_at;
            } else {
                seq.id = id;
                scheduler.add(seq);
            }
            self.entries.insert(id, entry);
        }
    }

    /// Drops a request everywhere: its blocks now, its shard state at the next step, its
    /// proposer; its siblings still waiting start on their own.
    pub(super) fn retire(&mut self, id: RequestId, scheduler: &mut Scheduler) -> Option<Entry> {
        if self.beams.owns(id) {
            return None;
        }
        scheduler.finish(id);
        if let Some(speculation) = self.speculation.as_mut() {
            speculation.forget(id);
        }
        self.start_siblings(id, false, scheduler);
        self.entries.remove(&id)
    }

    /// Retires a request and tells its handler why it failed.
    pub(super) fn fail(&mut self, id: RequestId, error: InferError, scheduler: &mut Scheduler) {
        // A beam fails its whole group.
        for mut entry in self.beams.remove_with(id, scheduler) {
            self.output.metrics.requests_failed.add(1);
            entry.spans.fail(&error);
            entry.send_last(Err(error.clone()));
        }
        if let Some(mut entry) = self.retire(id, scheduler) {
            self.output.metrics.requests_failed.add(1);
            tracing::warn!(request_id = &*entry.request_id, id, %error, "failed");
            entry.spans.fail(&error);
            entry.send_last(Err(error));
        }
    }

    /// Fails every request held (running, waiting, or waiting to fork) with `error` and
    /// forgets them; the scheduler is reset apart.
    pub(super) fn fail_all(&mut self, error: &InferError) {
        if let Some(speculation) = self.speculation.as_mut() {
            speculation.forget_all();
        }
        let siblings = self.siblings.drain().flat_map(|(_, s)| s).map(|s| s.entry);
        let beams = self.beams.drain();
        for mut entry in self
            .entries
            .drain()
            .map(|(_, e)| e)
            .chain(siblings)
            .chain(beams)
        {
            self.output.metrics.requests_failed.add(1);
            entry.spans.fail(error);
            entry.send_last(Err(error.clone()));
        }
    }

    /// Retires the requests whose client went away (the stream was cut or the handler
    /// dropped); false when there were none.
    pub(super) fn drop_cancelled(&mut self, scheduler: &mut Scheduler) -> bool {
        let gone: Vec<RequestId> = self
            .entries
            .iter()
            .filter(|(_, e)| e.events.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for &id in &gone {
            if let Some(entry) = self.retire(id, scheduler) {
                let request_id = &*entry.request_id;
                tracing::debug!(request_id, id, "client went away; cancelled");
            }
        }
        let beams_gone = self.beams.drop_cancelled(scheduler);
        !gone.is_empty() || beams_gone
    }

    /// The requests of `joined` start computing now (the first step with them is sent).
    pub(super) fn started(&mut self, joined: &[pb::NewRequest], at: Instant) {
        for joined in joined {
            if let Some(entry) = self.entries.get_mut(&joined.id) {
                entry.started_at.get_or_insert(at);
            }
        }
    }

    /// Request `id` was admitted into the running batch: its place in the waiting queue
    /// frees; returns when it was queued.
    pub(super) fn left_queue(&mut self, id: RequestId) -> Option<Instant> {
        let Some(entry) = self.entries.get_mut(&id) else {
            return self.beams.left_queue(id);
        };
        entry.slot = None;
        Some(entry.queued_at)
    }

    /// The `prefill` spans of the traced requests computing part of their prompt in
    /// `step` (ended when its answer comes); nothing to do with traces off.
    pub(super) fn prefill_spans(&mut self, step: &pb::StepRequest) -> Vec<Span> {
        if telemetry::tracer().is_none() {
            return Vec::new();
        }
        let joined = step
            .joined
            .iter()
            .map(|r| (r.id, r.num_compute, r.num_cached));
        let continuing = step.continuing.iter().map(|r| (r.id, r.num_compute, 0));
        joined
            .chain(continuing)
            .filter_map(|(id, tokens, cached)| {
                let entry = self.entries.get_mut(&id)?;
                entry.spans.prefill_chunk(step.step_id, tokens, cached)
            })
            .collect()
    }

    /// Sends request `id` the tokens its step sampled (`generation`), `generated` before
    /// them, with its prompt's logprobs the first time; stops at the one that ends it.
    pub(super) fn emit_sampled(
        &mut self,
        generation: &pb::Generation,
        generated: usize,
    ) -> Outcome {
        let id = generation.id;
        let Self {
            output, entries, ..
        } = self;
        let Some(entry) = entries.get_mut(&id) else {
            return Outcome::Gone; // cancelled while the step ran
        };
        let mut prompt = entry
            .prompt
            .take()
            .map(|prompt| output.prompt_tokens(&prompt, generation));
        for (i, &token_id) in generation.token_ids.iter().enumerate() {
            let top_tokens = generation
                .top_tokens
                .get(i)
                .map(|top| output.top_tokens(top))
                .unwrap_or_default();
            let token = NextToken {
                id: token_id,
                sampled: Some((generation.logprobs.get(i).copied(), top_tokens)),
            };
            if output.emit(entry, id, token, generated + i + 1, prompt.take()) {
                return Outcome::Ended;
            }
            if let Err(message) = entry.advance_grammar(token_id, &output.eos) {
                return Outcome::Failed(message);
            }
        }
        Outcome::Continues
    }

    /// Sends request `id` the tokens its grammar forces next (`generated` before them)
    /// and returns them: appended as generated tokens the next step computes (a short
    /// chunk) instead of sampling them one step each. The last allowed token is always
    /// sampled, so that length ends a request as it would without forcing.
    pub(super) fn emit_forced(&mut self, id: RequestId, generated: usize) -> (Vec<u32>, Outcome) {
        let Self {
            output, entries, ..
        } = self;
        let Some(entry) = entries.get_mut(&id) else {
            return (Vec::new(), Outcome::Gone);
        };
        let room = entry.max_new_tokens.saturating_sub(generated + 1);
        let Some(grammar) = entry.grammar.as_mut() else {
            return (Vec::new(), Outcome::Continues);
        };
        let mut forced = grammar.fast_forward(room);
        for (i, &token_id) in forced.iter().enumerate() {
            let token = NextToken {
                id: token_id,
                sampled: None,
            };
            if output.emit(entry, id, token, generated + i + 1, None) {
                forced.truncate(i + 1);
                return (forced, Outcome::Ended);
            }
        }
        (forced, Outcome::Continues)
    }
}
