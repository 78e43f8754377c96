//! The SSE answer of a streamed response: each `Writer` event as `event: <type>` and
//! `data: <event>`, the finished response kept (`Keep`) once its last event is written.
//! Unlike chat's stream, it ends without `[DONE]`, as OpenAI's does.

use std::convert::Infallible;

use axum::http::{HeaderMap, HeaderValue};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use futures::stream::{self, StreamExt};
use tokio_stream::wrappers::UnboundedReceiverStream;

use super::events::{Ending, Event, Writer};
use super::keep::{Keep, NAMES};
use super::object::ResponseUsage;
use crate::api::ApiError;
use crate::infer::Submitted;

/// Streams the one sample of `submitted` through `writer`.
pub(super) fn respond(submitted: Submitted, mut writer: Writer, keep: Keep) -> Response {
    let prompt_tokens = submitted.request.input_ids.len();
    let opening = writer.opening();
    let mut keep = Some(keep);
    let events = submitted
        .samples
        .into_iter()
        .map(UnboundedReceiverStream::new);
    let body = stream::select_all(events).flat_map(move |result| {
        let events = match result {
            Ok(event) => {
                let ending = event.end.as_ref().map(|end| Ending {
                    finish_reason: end.finish_reason.into(),
                    usage: ResponseUsage::new(prompt_tokens, end.generated_tokens),
                });
                let ended = ending.is_some();
                let events = writer.next(&event.token.text, ending);
                if let Some(keep) = keep.take_if(|_| ended) {
                    keep.keep(writer.response());
                }
                events
            }
            Err(e) => writer.error(ApiError::from_infer(e, &NAMES).body.error),
        };
        stream::iter(events.iter().map(sse).collect::<Vec<_>>())
    });
    let events = stream::iter(opening.iter().map(sse).collect::<Vec<_>>()).chain(body);
    let mut headers = HeaderMap::new();
    headers.insert("x-prompt-tokens", prompt_tokens.into());
    headers.insert("x-accel-buffering", HeaderValue::from_static("no"));
    (headers, Sse::new(events)).into_response()
}

fn sse(event: &Event) -> Result<SseEvent, Infallible> {
    let value = serde_json::to_value(event).unwrap_or_default();
    let kind = value["type"].as_str().unwrap_or("error").to_string();
    Ok(SseEvent::default().event(kind).data(value.to_string()))
}
