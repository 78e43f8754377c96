//! The headers every API's answers carry for operators.

use axum::http::{HeaderMap, HeaderValue};

use crate::infer::End;
use crate::validation::ValidRequest;

/// Headers for operators: where the time went and how many tokens it took.
pub fn timing_headers(request: &ValidRequest, samples: &[&End]) -> HeaderMap {
    let mut headers = HeaderMap::new();
    let generated: usize = samples.iter().map(|e| e.generated_tokens).sum();
    let queue = samples
        .iter()
        .map(|e| e.queue_time)
        .max()
        .unwrap_or_default();
    let inference = samples
        .iter()
        .map(|e| e.inference_time)
        .max()
        .unwrap_or_default();
    let per_token = samples
        .iter()
        .map(|e| e.inference_time / e.generated_tokens.max(1) as u32)
        .max()
        .unwrap_or_default();
    let values = [
        ("x-queue-time", queue.as_millis().to_string()),
        ("x-inference-time", inference.as_millis().to_string()),
        ("x-time-per-token", per_token.as_millis().to_string()),
        ("x-prompt-tokens", request.input_ids.len().to_string()),
        ("x-generated-tokens", generated.to_string()),
    ];
    for (name, value) in values {
        if let Ok(v) = HeaderValue::from_str(&value) {
            headers.insert(name, v);
        }
    }
    headers
}

/// Headers for operators that are known when a stream starts (TGI sends the last two on
/// its streams too): the prompt's tokens, its characters, and no proxy buffering.
pub fn stream_headers(request: &ValidRequest, characters: usize) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert("x-prompt-tokens", request.input_ids.len().into());
    headers.insert("x-compute-characters", characters.into());
    headers.insert("x-accel-buffering", HeaderValue::from_static("no"));
    headers
}
