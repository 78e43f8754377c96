//! The SSE answer both routes stream: opening chunks, one chunk per token of every
//! choice as it comes (errors in OpenAI's shape), the usage chunk when asked, `[DONE]`.

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::http::{HeaderMap, HeaderValue};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures::stream::{self, BoxStream, Stream, StreamExt};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc::UnboundedReceiver;
use tokio_stream::wrappers::UnboundedReceiverStream;
use utoipa::ToSchema;

use crate::api::{ApiError, ParamNames, Usage};
use crate::infer::{EventResult, Submitted, TokenEvent};

#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct StreamOptions {
    /// Send a last chunk with the usage counts (and `choices: []`).
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// A stream chunk's `usage`, as OpenAI sends it: `null` on every chunk but the last when
/// the client asked for the usage chunk, no field at all otherwise (`None`).
pub(super) type ChunkUsage = Option<Option<Usage>>;

/// The `usage` of a chunk before the last.
pub(super) fn no_usage_yet(include_usage: bool) -> ChunkUsage {
    include_usage.then_some(None)
}

/// Whether the client asked for the usage chunk.
pub(super) fn include_usage(options: Option<StreamOptions>) -> bool {
    options.and_then(|o| o.include_usage).unwrap_or(false)
}

/// How one route's chunks look.
pub(super) struct Chunks<C, T, U> {
    /// Sent before any token (chat: each choice's role).
    pub opening: Vec<C>,
    /// The chunks for one token of choice `index` (none, one or several).
    pub token: T,
    /// The last chunk, with the counts.
    pub usage: U,
}

/// Streams every sample of `submitted` (`n` choices per prompt, choice index
/// `prompt * n + sample`) as `chunks` shapes them.
pub(super) fn respond<C, T, U>(
    submitted: Vec<Submitted>,
    n: usize,
    names: ParamNames,
    include_usage: bool,
    chunks: Chunks<C, T, U>,
) -> Response
where
    C: Serialize + Send + 'static,
    T: FnMut(usize, TokenEvent) -> Vec<C> + Send + 'static,
    U: FnOnce(Usage) -> C + Send + 'static,
{
    let Chunks {
        opening,
        token: mut token_chunk,
        usage: usage_chunk,
    } = chunks;
    let (prompt_tokens, events) = merged(submitted, n);
    // Counted as the stream goes, read once it has ended.
    let completion_tokens = Arc::new(AtomicUsize::new(0));
    let counter = completion_tokens.clone();
    let body = events.flat_map(move |(index, event)| {
        let sent: Vec<_> = match event {
            Ok(event) => {
                if let Some(end) = &event.end {
                    counter.fetch_add(end.generated_tokens, Ordering::Relaxed);
                }
                token_chunk(index, event).iter().map(sse_json).collect()
            }
            Err(e) => vec![sse_json(&ApiError::from_infer(e, &names).body)],
        };
        stream::iter(sent)
    });
    let tail = stream::once(async move {
        let completion_tokens = completion_tokens.load(Ordering::Relaxed);
        let mut out = Vec::new();
        if include_usage {
            out.push(sse_json(&usage_chunk(Usage::new(
                prompt_tokens,
                completion_tokens,
            ))));
        }
        out.push(Ok(Event::default().data("[DONE]")));
        stream::iter(out)
    })
    .flatten();
    let events = stream::iter(opening.iter().map(sse_json).collect::<Vec<_>>())
        .chain(body)
        .chain(tail);
    // What operators can know when the stream starts (the rest comes in `usage`).
    let mut headers = HeaderMap::new();
    headers.insert("x-prompt-tokens", prompt_tokens.into());
    headers.insert("x-accel-buffering", HeaderValue::from_static("no"));
    (headers, Sse::new(events)).into_response()
}

fn sse_json<T: Serialize>(value: &T) -> Result<Event, Infallible> {
    Ok(Event::default().data(serde_json::to_string(value).unwrap_or_default()))
}

/// The prompt tokens of every request, and every sample of every request as one stream
/// of (choice index, event).
fn merged(
    submitted: Vec<Submitted>,
    n: usize,
) -> (usize, impl Stream<Item = (usize, EventResult)>) {
    let prompt_tokens = submitted.iter().map(|s| s.request.input_ids.len()).sum();
    let prompts = submitted
        .into_iter()
        .enumerate()
        .map(|(p, s)| samples(p * n, s.samples));
    (prompt_tokens, stream::select_all(prompts))
}

/// One prompt's samples as one stream, choice indices from `first_index`. Only the
/// first sample's first event carries the prompt's logprobs, and the siblings start
/// after it (`Loop::admit`): it is read first and its prompt logprobs copied into each
/// sibling's first event, so every choice can show them.
fn samples(
    first_index: usize,
    receivers: Vec<UnboundedReceiver<EventResult>>,
) -> BoxStream<'static, (usize, EventResult)> {
    let mut receivers = receivers.into_iter();
    let Some(mut first) = receivers.next() else {
        return stream::empty().boxed();
    };
    let siblings: Vec<_> = receivers.collect();
    stream::once(async move {
        let opening = first.recv().await;
        let prefill = match &opening {
            Some(Ok(e)) => (e.prefill.clone(), e.prefill_top_tokens.clone()),
            _ => Default::default(),
        };
        let first = stream::iter(opening)
            .chain(UnboundedReceiverStream::new(first))
            .map(move |e| (first_index, e));
        let siblings = siblings.into_iter().enumerate().map(move |(j, rx)| {
            let prefill = prefill.clone();
            UnboundedReceiverStream::new(rx)
                .enumerate()
                .map(move |(k, e)| {
                    let e = e.map(|mut e| {
                        if k == 0 {
                            (e.prefill, e.prefill_top_tokens) = prefill.clone();
                        }
                        e
                    });
                    (first_index + 1 + j, e)
                })
                .boxed()
        });
        stream::select_all(std::iter::once(first.boxed()).chain(siblings))
    })
    .flatten()
    .boxed()
}
