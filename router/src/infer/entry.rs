//! One sample of a request as the batching loop keeps it beside the scheduler's
//! `Sequence`: its event stream, its text so far (incremental detokenization, stop
//! strings), its grammar, its timings and what it holds until it ends. `on_token` turns
//! its next token into the event its handler receives and says whether it ended it.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::mpsc;

use super::admission::{Held, QueueSlot};
use super::events::{End, EventResult, FinishReason, Token, TokenEvent};
use super::spans::RequestSpans;
use crate::blocks::RequestId;
use crate::constraints::GrammarState;
use crate::detokenize::{Detokenizer, TokenizerInfo};
use crate::metrics::{Finished, FinishedReason, Metrics};
use crate::request_scope::RequestContext;
use crate::scheduler::Sequence;
use crate::stop::StopMatcher;
use crate::tenants::TenantUsage;
use crate::validation::ValidRequest;

/// Per-sample state the loop keeps beside the scheduler's `Sequence` (which counts the
/// tokens generated so far).
pub(super) struct Entry {
    pub(super) events: mpsc::UnboundedSender<EventResult>,
    /// The id its log lines carry.
    pub(super) request_id: Arc<str>,
    /// Its trace spans (nothing when untraced).
    pub(super) spans: RequestSpans,
    detokenizer: Detokenizer,
    stop: StopMatcher,
    pub(super) max_new_tokens: usize,
    ignore_eos: bool,
    /// Where the request is in its grammar (structured outputs, tool calls).
    pub(super) grammar: Option<GrammarState>,
    input_length: usize,
    text: String,
    prefix: Option<String>,
    seed: Option<u64>,
    /// The prompt, while its logprobs are still to be sent (with the first token).
    pub(super) prompt: Option<Vec<u32>>,
    cumulative_logprob: f32,
    /// Set before a beam search's hypothesis is sent: its score.
    pub(super) beam_score: Option<f32>,
    pub(super) queued_at: Instant,
    pub(super) started_at: Option<Instant>,
    first_token_at: Option<Instant>,
    pub(super) last_token_at: Option<Instant>,
    /// Released at the request's first step; shared by its samples.
    pub(super) slot: Option<Arc<QueueSlot>>,
    /// Shared by the samples of one request: its places free when the last one ends.
    /// `None` once this sample has sent its last event.
    held: Option<Arc<Held>>,
}

/// What the samples of one request have in common: when it was queued, its place in the
/// waiting queue, its permit, its request id and trace.
pub(super) struct SampleCommon {
    pub queued_at: Instant,
    pub slot: Arc<QueueSlot>,
    pub permit: Arc<Held>,
    pub context: RequestContext,
}

impl Entry {
    /// The state of sample `seq` of `request` before its first token.
    pub(super) fn new(
        events: mpsc::UnboundedSender<EventResult>,
        request: &ValidRequest,
        seq: &Sequence,
        seed: Option<u64>,
        common: &SampleCommon,
    ) -> Self {
        Self {
            events,
            request_id: common.context.id.clone(),
            spans: RequestSpans::queued(
                common.context.trace.as_ref(),
                common.queued_at,
                seq.prompt_len,
            ),
            detokenizer: Detokenizer::new(&seq.token_ids),
            stop: StopMatcher::new(request.stop.clone()),
            max_new_tokens: request.max_new_tokens,
            ignore_eos: request.ignore_eos,
            grammar: request.grammar.as_ref().map(GrammarState::new),
            input_length: seq.prompt_len,
            text: String::new(),
            prefix: request.prefix.clone(),
            seed,
            prompt: seq.prompt_logprobs.then(|| request.input_ids.clone()),
            cumulative_logprob: 0.0,
            beam_score: None,
            queued_at: common.queued_at,
            started_at: None,
            first_token_at: None,
            last_token_at: None,
            slot: Some(common.slot.clone()),
            held: Some(common.permit.clone()),
        }
    }

    /// The account the request's tokens count to, when it has a tenant.
    pub(super) fn tenant(&self) -> Option<&TenantUsage> {
        self.held.as_ref().and_then(|held| held.tenant())
    }

    /// Sends the sample's last event (its end or its error) after giving up its share of
    /// the request's places: a client that sends its next request as soon as it reads
    /// this one's end must find its tenant's and the server's places free, not race the
    /// loop retiring this entry.
    pub(super) fn send_last(&mut self, event: EventResult) {
        self.held = None;
        let _ = self.events.send(event);
    }

    /// Counts, logs and traces the request's end (a sampled or a forced token ended it).
    pub(super) fn record_end(&mut self, metrics: &Metrics, id: RequestId, end: &End) {
        let now = Instant::now();
        let elapsed = now.saturating_duration_since(self.queued_at);
        let started = self.started_at.unwrap_or(self.queued_at);
        let first_token = self.first_token_at.unwrap_or(now);
        metrics.finish(&Finished {
            reason: match end.finish_reason {
                FinishReason::Length => FinishedReason::Length,
                FinishReason::EosToken | FinishReason::StopSequence => FinishedReason::Stop,
            },
            prompt_tokens: self.input_length,
            generation_tokens: end.generated_tokens,
            e2e: elapsed,
            prefill: first_token.saturating_duration_since(started),
            decode: now.saturating_duration_since(first_token),
            inference: end.inference_time,
        });
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
    pub(super) fn advance_grammar(&mut self, token: u32, eos: &HashSet<u32>) -> Result<(), String> {
        match self.grammar.as_mut() {
            Some(grammar) if !eos.contains(&token) => grammar.commit(token),
            _ => Ok(()),
        }
    }

    /// The event of token `id`, the request's `generated`-th: its text (what the stop
    /// strings let through) and, when it ends the request, how.
    pub(super) fn on_token(
        &mut self,
        tokenizer: &TokenizerInfo,
        eos: &HashSet<u32>,
        id: u32,
        generated: usize,
        logprob: Option<f32>,
        top_tokens: Vec<Token>,
    ) -> TokenEvent {
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
        if finish.is_none() && generated >= self.max_new_tokens {
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
            generated_tokens: generated,
            input_length: self.input_length,
            seed: self.seed,
            cumulative_logprob: self.cumulative_logprob,
            beam_score: self.beam_score,
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
