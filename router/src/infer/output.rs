//! Turning the tokens a step sampled into what a request's handler receives: text
//! (incremental detokenization, stop strings), end conditions (EOS, stop string, length),
//! per-token metrics, and the request's retirement once it ends.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::mpsc;

use super::batching_loop::Loop;
use super::events::{End, EventResult, FinishReason, Token, TokenEvent};
use super::handle::{Held, QueueSlot};
use super::spans::RequestSpans;
use crate::blocks::RequestId;
use crate::client::Backend;
use crate::constraints::GrammarState;
use crate::detokenize::{Detokenizer, TokenizerInfo};
use crate::error::InferError;
use crate::metrics::Metrics;
use crate::pb;
use crate::request_scope::RequestContext;
use crate::scheduler::Sequence;
use crate::stop::StopMatcher;
use crate::validation::ValidRequest;

/// Per-request state the loop keeps beside the scheduler's `Sequence`.
pub(super) struct Entry {
    pub(super) events: mpsc::UnboundedSender<EventResult>,
    /// The id its log lines carry.
    pub(super) request_id: Arc<str>,
    /// Its trace spans (nothing when untraced).
    pub(super) spans: RequestSpans,
    detokenizer: Detokenizer,
    stop: StopMatcher,
    max_new_tokens: usize,
    ignore_eos: bool,
    /// Where the request is in its grammar (structured outputs, tool calls).
    pub(super) grammar: Option<GrammarState>,
    input_length: usize,
    generated: usize,
    text: String,
    prefix: Option<String>,
    seed: Option<u64>,
    /// The prompt, while its logprobs are still to be sent (with the first token).
    prompt: Option<Vec<u32>>,
    cumulative_logprob: f32,
    pub(super) queued_at: Instant,
    pub(super) started_at: Option<Instant>,
    first_token_at: Option<Instant>,
    last_token_at: Option<Instant>,
    /// Released at the request's first step; shared by its samples.
    pub(super) slot: Option<Arc<QueueSlot>>,
    /// Shared by the samples of one request: the slot frees when the last one ends.
    held: Arc<Held>,
}

/// What the samples of one request share: when it was queued, its place in the waiting
/// queue, its permit, its request id and trace.
pub(super) struct Shared {
    pub queued_at: Instant,
    pub slot: Arc<QueueSlot>,
    pub permit: Arc<Held>,
    pub context: RequestContext,
}

impl<B: Backend> Loop<B> {
    /// Applies one request's sampled tokens: text, stops, events, retirement.
    pub(super) fn apply(&mut self, generation: pb::Generation) {
        let id = generation.id;
        // Its first token: the prompt is computed, so its siblings fork from it now.
        self.start_siblings(id, true);
        let Some(entry) = self.entries.get_mut(&id) else {
            return; // cancelled while the step ran
        };
        let mut accepted = Vec::with_capacity(generation.token_ids.len());
        let mut finished = false;
        let mut grammar_error = None;
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
            if let Some(tenant) = entry.held.tenant() {
                tenant.generation_tokens.add(1);
            }
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
                entry.record_end(&self.metrics, id, end);
            }
            let _ = entry.events.send(Ok(event));
            if finished {
                break;
            }
            if let Err(message) = entry.advance_grammar(token_id, &self.eos) {
                grammar_error = Some(message);
                break;
            }
        }
        if let Some(message) = grammar_error {
            self.fail(id, InferError::Generation(message));
            return;
        }
        if finished {
            self.retire(id);
            return;
        }
        self.scheduler.append_tokens(id, &accepted);
        if let Some(speculation) = self.speculation.as_mut() {
            speculation.extend(id, &accepted);
        }
        self.fast_forward(id);
    }

    /// Appends the tokens `id`'s grammar forces next, as generated tokens the next step
    /// computes (a short chunk) instead of sampling them one step each.
    fn fast_forward(&mut self, id: RequestId) {
        // Unconstrained requests stop at the first check (this runs for every token).
        let constrained = self.entries.get(&id).is_some_and(|e| e.grammar.is_some());
        // Forced tokens have no alternatives to report, and a pending token (a step
        // scheduled ahead) would come before them.
        if !self.fast_forward
            || !constrained
            || !self
                .scheduler
                .get(id)
                .is_some_and(|s| s.pending == 0 && s.top_n_tokens == 0)
        {
            return;
        }
        let Some(entry) = self.entries.get_mut(&id) else {
            return;
        };
        let Some(grammar) = entry.grammar.as_mut() else {
            return;
        };
        // The last allowed token is sampled, so that length ends a request as it would
        // without fast-forward.
        let room = entry.max_new_tokens.saturating_sub(entry.generated + 1);
        let forced = grammar.fast_forward(room);
        if forced.is_empty() {
            return;
        }
        let mut appended = Vec::with_capacity(forced.len());
        let mut finished = false;
        let tenant = entry.held.clone();
        for &token_id in &forced {
            self.metrics.generation_tokens.add(1);
            if let Some(tenant) = tenant.tenant() {
                tenant.generation_tokens.add(1);
            }
            self.metrics.fast_forward_tokens.add(1);
            let event = entry.on_token(&self.tokenizer, &self.eos, token_id, None, Vec::new());
            appended.push(token_id);
            finished = event.end.is_some();
            if let Some(end) = &event.end {
                entry.record_end(&self.metrics, id, end);
            }
            let _ = entry.events.send(Ok(event));
            if finished {
                break;
            }
        }
        if finished {
            self.retire(id);
        } else {
            self.scheduler.append_forced(id, &appended);
        }
    }
}

impl Entry {
    /// The state of sample `seq` of `request` before its first token.
    pub(super) fn new(
        events: mpsc::UnboundedSender<EventResult>,
        request: &ValidRequest,
        seq: &Sequence,
        seed: Option<u64>,
        shared: &Shared,
    ) -> Self {
        Self {
            events,
            request_id: shared.context.id.clone(),
            spans: RequestSpans::queued(
                shared.context.trace.as_ref(),
                shared.queued_at,
                seq.prompt_len,
            ),
            detokenizer: Detokenizer::new(&seq.token_ids),
            stop: StopMatcher::new(request.stop.clone()),
            max_new_tokens: request.max_new_tokens,
            ignore_eos: request.ignore_eos,
            grammar: request.grammar.as_ref().map(GrammarState::new),
            input_length: seq.prompt_len,
            generated: 0,
            text: String::new(),
            prefix: request.prefix.clone(),
            seed,
            prompt: seq.prompt_logprobs.then(|| request.input_ids.clone()),
            cumulative_logprob: 0.0,
            queued_at: shared.queued_at,
            started_at: None,
            first_token_at: None,
            last_token_at: None,
            slot: Some(shared.slot.clone()),
            held: shared.permit.clone(),
        }
    }

    /// Counts, logs and traces the request's end (a sampled or a forced token ended it).
    fn record_end(&mut self, metrics: &Metrics, id: RequestId, end: &End) {
        let elapsed = self.queued_at.elapsed();
        metrics.e2e.observe(elapsed.as_secs_f64());
        metrics.requests_succeeded.add(1);
        let ttft = self
            .first_token_at
            .map(|t| t.duration_since(self.queued_at));
        self.spans.end(end);
        tracing::info!(
            request_id = &*self.request_id,
            id,
            input_tokens = self.input_length,
            generated_tokens = end.generated_tokens,
            finish_reason = end.finish_reason.as_str(),
            total_ms = elapsed.as_millis() as u64,
            queue_ms = end.queue_time.as_millis() as u64,
            ttft_ms = ttft.map(|t| t.as_millis() as u64),
            "finished"
        );
    }

    /// Moves the request's grammar past a token it took; EOS is not fed (it ends the
    /// request, or with `ignore_eos` the grammar has already ended).
    fn advance_grammar(&mut self, token: u32, eos: &HashSet<u32>) -> Result<(), String> {
        match self.grammar.as_mut() {
            Some(grammar) if !eos.contains(&token) => grammar.commit(token),
            _ => Ok(()),
        }
    }

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
            self.spans.first_token();
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
            stop_sequence: self.stop.matched().map(str::to_string),
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
