//! A request's trace spans in the batching loop, children of its server span: `queue`
//! (admission to its first step), one `prefill` per chunk of its prompt (sent to the
//! shards until their answer, with the chunk's token counts), and `decode` (its first
//! token to its last, with the number of tokens). Decode steps have no span each: a
//! request's hundreds of them would swamp a trace, and the server's steps are shared by
//! the whole batch anyway.
//!
//! Untraced requests (traces off, or a request without a server span) hold nothing
//! here, and the loop skips the per-step work (`RequestBook::prefill_spans`).

use std::time::{Instant, SystemTime};

use opentelemetry::trace::{Span as _, Status, Tracer as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::trace::{SdkTracer, Span};

use super::events::End;
use crate::error::InferError;
use crate::telemetry;

/// The spans of one sample of a request.
pub(super) struct RequestSpans(Option<Box<Open>>);

struct Open {
    tracer: &'static SdkTracer,
    parent: Context,
    queue: Option<Span>,
    decode: Option<Span>,
    /// Its first token came: later computations (after a preemption) are not prefill.
    decoding: bool,
    /// Prompt tokens not yet scheduled: a step sent ahead of the prompt's last chunk's
    /// answer computes the pending first token, which is no prefill.
    prompt_left: usize,
}

impl RequestSpans {
    /// A request admitted now, queued since `queued_at`, under `parent` (its server span).
    pub fn queued(parent: Option<&Context>, queued_at: Instant, prompt_tokens: usize) -> Self {
        let (Some(tracer), Some(parent)) = (telemetry::tracer(), parent) else {
            return Self(None);
        };
        let since = SystemTime::now() - queued_at.elapsed();
        let queue = tracer
            .span_builder("queue")
            .with_start_time(since)
            .with_attributes([KeyValue::new("cadence.prompt_tokens", prompt_tokens as i64)])
            .start_with_context(tracer, parent);
        Self(Some(Box::new(Open {
            tracer,
            parent: parent.clone(),
            queue: Some(queue),
            decode: None,
            decoding: false,
            prompt_left: prompt_tokens,
        })))
    }

    /// The request is scheduled for the first time: its wait is over.
    pub fn scheduled(&mut self) {
        if let Some(open) = &mut self.0 {
            open.queue.take(); // a span ends when dropped
        }
    }

    /// The span of a chunk of its prompt the shards compute in step `step_id`: `tokens`
    /// of them, after `cached` found in the prefix cache. `None` once it decodes.
    pub(super) fn prefill_chunk(&mut self, step_id: u64, tokens: u32, cached: u32) -> Option<Span> {
        self.scheduled();
        let open = self
            .0
            .as_mut()
            .filter(|open| !open.decoding && open.prompt_left > 0)?;
        open.prompt_left = open
            .prompt_left
            .saturating_sub(tokens as usize + cached as usize);
        let span = open
            .tracer
            .span_builder("prefill")
            .with_attributes([
                KeyValue::new("cadence.step_id", step_id as i64),
                KeyValue::new("cadence.prefill.tokens", i64::from(tokens)),
                KeyValue::new("cadence.prefill.cached_tokens", i64::from(cached)),
            ])
            .start_with_context(open.tracer, &open.parent);
        Some(span)
    }

    /// Its first token came.
    pub fn first_token(&mut self) {
        if let Some(open) = &mut self.0 {
            open.queue.take();
            open.decoding = true;
            let decode = open.tracer.start_with_context("decode", &open.parent);
            open.decode = Some(decode);
        }
    }

    /// It ended as `end` says.
    pub fn end(&mut self, end: &End) {
        if let Some(decode) = self.0.as_mut().and_then(|open| open.decode.as_mut()) {
            decode.set_attributes([
                KeyValue::new("cadence.generated_tokens", end.generated_tokens as i64),
                KeyValue::new("cadence.finish_reason", end.finish_reason.as_str()),
            ]);
            decode.end();
        }
    }

    /// It failed: the span it was in says why.
    pub fn fail(&mut self, error: &InferError) {
        let Some(open) = &mut self.0 else {
            return;
        };
        if let Some(span) = open.decode.as_mut().or(open.queue.as_mut()) {
            span.set_status(Status::error(error.to_string()));
        }
    }
}
